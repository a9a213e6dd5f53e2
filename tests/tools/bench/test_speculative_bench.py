"""`flashmemory bench-spec` end to end on the tiny model: every engine decodes every prompt, the
table says the speed-up and acceptance, and the drafters' output equals the target's."""

from __future__ import annotations

import json

from flashmemory.cli import main


def test_bench_spec_runs_the_target_and_each_drafter_on_every_prompt(tiny_llama, tmp_path, capsys):
    out = tmp_path / "spec.json"
    text = tmp_path / "text.txt"
    text.write_text("Alice was beginning to get very tired of sitting by her sister. " * 60)
    assert main(["bench-spec", "--model", str(tiny_llama), "--draft-model", str(tiny_llama),
                 "--ngram", "--runs", "2", "--new-tokens", "8", "--threads", "1",
                 "--max-seq-len", "256", "--text", str(text), "--summary-tokens", "120",
                 "--profile", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["cells"]) == {"target", "draft K=4", "ngram K=4"}
    for cells in report["cells"].values():
        assert set(cells) == {"chat-1", "chat-2", "code", "summary"}
        assert all(len(c["decode_tok_s"]) == 2 and c["differing"] == 0 for c in cells.values())
    assert report["acceptance"]["draft K=4"]  # the target drafting for itself: accepted
    assert set(report["profile_ms"]) >= {"target_decode_ms", "draft_decode_ms"}
    assert "| code | draft K=4 |" in capsys.readouterr().out
