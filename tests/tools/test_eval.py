"""`flashmemory eval` end to end on a tiny model: the baseline scores against itself, configs are compared."""

from __future__ import annotations

import json

import pytest

from flashmemory.cli import main
from flashmemory.errors import ConfigError
from flashmemory.tools.eval import parse_config
from tests.helpers import write_tiny_model

TEXT = ("Alice was beginning to get very tired of sitting by her sister on the bank. " * 40)


def test_eval_reports_every_configuration(tiny_llama, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    out_json = tmp_path / "r.json"
    rc = main(["eval", str(text), "--model", str(tiny_llama), "--window-tokens", "200", "--decode-tokens", "24",
               "--config", "tiny:block_size=8,active_window=32,warm_tokens=32,prefill_chunk_tokens=64",
               "--passkey-tokens", "120", "--passkey-depths", "0.5", "--passkey-window", "32", "--json", str(out_json)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "| exact-fp16 |" in table and "| tiny |" in table
    report = json.loads(out_json.read_text())
    base, tiny = report["results"]
    assert base["mean_kl"] == 0 and base["top1_agreement"] == 1
    assert tiny["mean_kl"] > 0 and 0 < tiny["top1_agreement"] <= 1
    assert 0 < tiny["device_kv_bytes"] and tiny["kv_stats"]["bytes_moved_L1->L2"] > 0
    assert set(tiny["passkey"]) == {"0.5"}


def test_config_spec_is_parsed_and_checked():
    assert parse_config("a:kv_precision=int4,active_window=512,selection=exact") == (
        "a", {"kv_precision": "int4", "active_window": 512, "selection": "exact", "kv_cache": "tiered"})
    with pytest.raises(ConfigError, match="NAME:key=value"):
        parse_config("no-colon")
    with pytest.raises(ConfigError, match="not key=value"):
        parse_config("a:oops")


def test_eval_with_kv_snapshot_restores_the_prompt_and_decodes_the_same(tmp_path):
    model = tmp_path / "model"
    write_tiny_model(model, max_position_embeddings=1024)  # room for more than one 512-token prefill chunk
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 2)
    snap = tmp_path / "prompt.kvsnap"
    args = ["eval", str(text), "--model", str(model), "--window-tokens", "700", "--decode-tokens", "16",
            "--config", "fp16-exact:kv_precision=fp16,selection=exact,block_size=8,active_window=64",
            "--passkey-depths", "--kv-snapshot", str(snap)]
    reports = []
    for i in range(2):  # the first run writes the snapshot, the second restores it in every configuration
        assert main([*args, "--json", str(tmp_path / f"r{i}.json")]) == 0
        reports.append(json.loads((tmp_path / f"r{i}.json").read_text()))
    made, reused = reports
    assert snap.exists() and made["kv_snapshot"]["made_by"]["prefill_ppl"] > 1
    assert [r["restored_tokens"] for r in made["results"]] == [0, 512]
    assert [r["restored_tokens"] for r in reused["results"]] == [512, 512]
    assert reused["results"][0]["prefill_ppl"] is None
    for a, b in zip(made["results"], reused["results"]):
        assert abs(a["decode_ppl"] - b["decode_ppl"]) <= 1e-4 * a["decode_ppl"]
    assert reused["results"][1]["top1_agreement"] == 1.0
