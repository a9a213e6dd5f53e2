"""The `flashmemory generate` command: streaming output, summary line, and clear errors with exit codes."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from flashmemory.cli import EXIT_ERROR, main


def test_generate_streams_text_and_prints_a_summary(tiny_llama, capsys):
    rc = main(["generate", "--model", str(tiny_llama), "--prompt", "Alice was", "--max-new-tokens", "12"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert out.strip()
    assert "prompt" in err and "TTFT" in err and "tok/s" in err and "peak RSS" in err


def test_generate_reads_the_prompt_from_a_file_and_from_stdin(tiny_llama, tmp_path, capsys, monkeypatch):
    prompt = tmp_path / "p.txt"
    prompt.write_text("Alice was")
    args = ["generate", "--model", str(tiny_llama), "--max-new-tokens", "6", "--seed", "1", "--temperature", "0.8"]
    assert main([*args, "--prompt-file", str(prompt)]) == 0
    from_file = capsys.readouterr().out
    monkeypatch.setattr(sys, "stdin", io.StringIO("Alice was"))
    assert main(args) == 0
    assert capsys.readouterr().out == from_file


def test_chat_with_system_message(tiny_llama, capsys):
    rc = main(["generate", "--model", str(tiny_llama), "--chat", "--system", "Be brief.", "--prompt", "hi",
               "--max-new-tokens", "4"])
    assert rc == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "2"], "top_p"),
        (["--max-new-tokens", "0"], "max_new_tokens"),
        (["--model", "/no/such/model"], "does not exist"),
        (["--prompt-file", "/no/such/file"], "cannot read --prompt-file"),
        (["--system", "x"], "--system only applies with --chat"),
    ],
)
def test_bad_input_exits_with_a_clear_error(tiny_llama, capsys, args, message):
    base = ["generate", "--model", str(tiny_llama)]
    if "--prompt-file" not in args:
        base += ["--prompt", "hello"]
    rc = main(base + args)
    err = capsys.readouterr().err
    assert rc == EXIT_ERROR
    assert err.startswith("error:") and message in err
    assert "Traceback" not in err


def test_prompt_too_long_is_an_error_not_a_crash(tiny_llama, capsys):
    rc = main(["generate", "--model", str(tiny_llama), "--max-seq-len", "16", "--prompt", "Alice was " * 20])
    err = capsys.readouterr().err
    assert rc == EXIT_ERROR and "maximum context length is 16 tokens" in err


def test_module_entry_point_runs(tiny_llama):
    proc = subprocess.run(
        [sys.executable, "-m", "flashmemory", "generate", "--model", str(tiny_llama), "--prompt", "Alice",
         "--max-new-tokens", "3"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


def test_generate_stats_show_levels_and_prefetch(tiny_llama, tmp_path, capsys):
    prompt = tmp_path / "p.txt"
    prompt.write_text(" ".join(f"w{i}" for i in range(45)))  # ~180 tokens of the tiny vocabulary
    args = ["generate", "--model", str(tiny_llama), "--prompt-file", str(prompt), "--max-new-tokens", "6", "--stats",
            "--block-size", "8", "--active-window", "16", "--warm-tokens", "16", "--prefetch-strategy", "adaptive"]
    assert main(args) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    for line in ("L0 device", "L1 host", "L2 disk", "selected", "prefetch   L2 hit rate", "per decode step"):
        assert line in err


def test_ctrl_c_during_prefill_exits_130_and_leaves_no_cold_zone_file(tiny_llama, tmp_path, capsys, monkeypatch):
    from flashmemory.model.llama import LlamaModel

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # what Ctrl-C raises between two torch ops of a long prefill

    cold = tmp_path / "cold"
    monkeypatch.setattr(LlamaModel, "forward", interrupted)
    rc = main(["generate", "--model", str(tiny_llama), "--prompt", "Alice was", "--cold-zone-dir", str(cold)])
    assert rc == 130
    assert capsys.readouterr().err.strip().endswith("interrupted")
    assert cold.is_dir() and not list(cold.iterdir())


def test_generate_with_a_draft_model_prints_what_was_kept(tiny_llama, capsys):
    rc = main(["generate", "--model", str(tiny_llama), "--draft-model", str(tiny_llama),
               "--num-speculative-tokens", "3", "--prompt", "Alice was", "--max-new-tokens", "12",
               "--stats"])
    out, err = capsys.readouterr()
    plain = main(["generate", "--model", str(tiny_llama), "--prompt", "Alice was",
                  "--max-new-tokens", "12"])
    assert rc == plain == 0 and capsys.readouterr().out == out  # the same greedy text
    assert "speculative draft:" in err and "drafted tokens kept" in err
