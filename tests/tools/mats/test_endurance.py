"""MATS-3 for a few seconds against a real server process running the tiny test model."""

from __future__ import annotations

import json

from flashmemory.tools import testing_cli

TINY_SERVER = "--active-window 32 --warm-tokens 32 --block-size 8 --max-num-seqs 8 --threads 1"


def test_mats3_keeps_a_real_server_busy_and_reports_latency_rss_and_disk(tiny_llama, tmp_path, capsys):
    status = testing_cli.main(["mats", "--level", "3", "--duration", "4", "--model", str(tiny_llama),
                               f"--server-arg={TINY_SERVER}", "--idle", "1", "--window", "2", "--rss-requests", "10",
                               "--no-progress", "--json", str(tmp_path / "r.json"), "--report", str(tmp_path / "r.txt"),
                               "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "r.json").read_text())
    assert status == 0, out
    assert report["passed"] and report["errors"] == 0 and report["ops"] > 10
    counters = report["counters"]
    assert counters["responses 5xx"] == 0 and counters["bad requests refused (4xx)"] >= 0
    assert counters["requests streamed"] > 0 and counters["RSS MiB at idle"] > 0
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["KV blocks held when idle"]["value"] == 0
    assert checks["RSS idle / first request"]["passed"] is True  # judged: more than 10 requests
    assert checks["GPU health (NVML)"]["value"].startswith("skipped") or "GPU 0" in out
    assert (tmp_path / "r.txt").read_text() == out
    assert "[INFO] MATS-3: endurance passed (" in out
    assert [p.name for p in tmp_path.iterdir()] == ["r.json", "r.txt"] or all(
        not p.name.startswith("flashmemory-mats-") for p in tmp_path.iterdir())  # its temporary folder is gone
