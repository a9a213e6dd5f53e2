"""The prefix cache side by side: a long document asked twice, the same after a restart, and an 8-turn chat, with
the prefix cache off (recompute) and on, for FlashMemory and (where installed) llama.cpp's own prefix reuse and
state save/load. One process per engine; TTFT from each engine's own first token; prints and writes JSON.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/prefix_cache_bench.py --doc-tokens 8000 --json docs/bench/prefix_cache.json

FlashMemory runs with OMP_WAIT_POLICY=PASSIVE, llama.cpp with OpenMP's default wait policy (PASSIVE makes its
per-node barriers sleep); both with --threads threads. "after restart": FlashMemory closes the engine (the cache is
written down to kv-cache.cold and its index), drops the file from the OS page cache and starts a new engine on the
same folder (persist_cache); llama.cpp saves its state to a file (llama_state_save_file) and a new Llama loads it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT.parent / "shared" / "data" / "alice29.txt"
QUESTIONS = ("\n\nQuestion: who is the story about? Answer:", "\n\nQuestion: what happened at the tea party? Answer:",
             "\n\nQuestion: how does the story end? Answer:")
TURNS = ["Tell me about the White Rabbit.", "Why was he late?", "What did Alice do next?", "Who else is there?",
         "Describe the Queen.", "What is the croquet game like?", "How does the trial go?", "Summarise it all."]


def _fm(args: argparse.Namespace) -> dict:
    from flashmemory import FlashMemoryEngine

    folder = Path(tempfile.mkdtemp(prefix="fm-prefix-bench-"))
    doc_ids = _doc_ids(args)
    knobs = dict(num_threads=args.threads)

    answers: dict[str, list[str]] = {"off": [], "on": []}

    def ask(engine, question: str, mode: str = "on") -> float:
        ids = doc_ids + engine.tokenizer.encode(question, add_special_tokens=False)
        answers[mode].append(engine.generate(ids, max_new_tokens=args.new_tokens, ignore_eos=True))
        return engine.last_stats.time_to_first_token_s

    out: dict = {"engine": "flashmemory", "answers": answers}
    off = FlashMemoryEngine(args.model, prefix_caching=False, **knobs)
    out["doc_off_ttft_s"] = [ask(off, q, "off") for q in QUESTIONS]  # the third: the reference for the restart
    out["chat_off"] = _chat(off, args)
    out["doc_chat_off"] = _chat(off, args, _excerpt(off, args))
    off.close()
    on = FlashMemoryEngine(args.model, cold_zone_dir=str(folder), persist_cache=True, **knobs)
    out["doc_on_ttft_s"] = [ask(on, q) for q in QUESTIONS[:2]]
    out["chat_on"] = _chat(on, args)
    out["doc_chat_on"] = _chat(on, args, _excerpt(on, args))
    started = time.perf_counter()
    on.close()  # writes the cached blocks down and publishes the index
    out["shutdown_s"] = time.perf_counter() - started
    out["cache_file_bytes"] = sum(p.stat().st_blocks * 512 for p in folder.iterdir())
    started = time.perf_counter()
    again = FlashMemoryEngine(args.model, cold_zone_dir=str(folder), persist_cache=True,
                              cold_zone_uncached_reads=True, **knobs)
    out["restart_load_s"] = time.perf_counter() - started
    read_before = again.stats().get("L2_bytes_read", 0)
    out["doc_restart_ttft_s"] = ask(again, QUESTIONS[2])
    stats = again.stats()
    out["restart_bytes_read"] = stats.get("L2_bytes_read", 0) - read_before
    out["restart_bytes_restored"] = stats.get("bytes_moved_L2->L1", 0)
    out["restart_read_mb_s"] = out["restart_bytes_read"] / 2**20 / max(out["doc_restart_ttft_s"], 1e-9)
    out["restart_prefix_hits"] = stats.get("prefix_cache_hits", 0)
    again.close()
    return out


def _excerpt(engine, args: argparse.Namespace) -> str:
    """A system prompt that carries --chat-doc-tokens of the text (a chat about a document)."""
    text = Path(args.text).read_text(encoding="utf-8", errors="replace")
    return "Answer questions about this text.\n\n" + engine.tokenizer.decode(
        engine.tokenizer.encode(text)[: args.chat_doc_tokens])


def _chat(engine, args: argparse.Namespace, system: str = "You answer in two sentences.") -> dict:
    history: list[dict[str, str]] = [{"role": "system", "content": system}]
    ttft, started = [], time.perf_counter()
    for turn in TURNS:
        history.append({"role": "user", "content": turn})
        answer = engine.chat(history, max_new_tokens=args.new_tokens, ignore_eos=True)
        ttft.append(engine.last_stats.time_to_first_token_s)
        history.append({"role": "assistant", "content": answer})
    return {"total_s": time.perf_counter() - started, "ttft_s": ttft, "answers": [m["content"] for m in history[2::2]]}


def _llamacpp(args: argparse.Namespace) -> dict:
    import llama_cpp

    from flashmemory.model.default_model import default_model_path
    from flashmemory.tools.bench.llamacpp_open import open_llama

    path = args.model or str(default_model_path())
    doc_ids = _doc_ids(args)

    def load():
        return open_llama(model_path=path, n_ctx=min(8192, args.doc_tokens + 512),
                          n_threads=args.threads,
                               n_threads_batch=args.threads, n_batch=512, verbose=False)

    def ask(llm, question: str) -> float:
        ids = doc_ids + llm.tokenize(question.encode(), add_bos=False, special=False)
        started = time.perf_counter()
        for _ in llm.create_completion(ids, max_tokens=args.new_tokens, stream=True, temperature=0.0):
            return time.perf_counter() - started
        return time.perf_counter() - started

    out: dict = {"engine": "llama.cpp", "version": llama_cpp.__version__}
    llm = load()
    out["doc_off_ttft_s"] = [ask(llm, q) for q in QUESTIONS[:1]]  # a fresh context: the whole prompt
    out["doc_on_ttft_s"] = [out["doc_off_ttft_s"][0], ask(llm, QUESTIONS[1])]  # its automatic prefix reuse
    state_path = Path(tempfile.mkdtemp(prefix="llama-state-")) / "state.bin"
    tokens = (llama_cpp.llama_token * llm.n_tokens)(*llm.eval_tokens)
    started = time.perf_counter()
    llama_cpp.llama_state_save_file(llm.ctx, str(state_path).encode(), tokens, llm.n_tokens)
    out["shutdown_s"] = time.perf_counter() - started
    out["cache_file_bytes"] = state_path.stat().st_size
    del llm
    started = time.perf_counter()
    again = load()
    buf = (llama_cpp.llama_token * (args.doc_tokens + 512))()
    count = ctypes.c_size_t(0)
    llama_cpp.llama_state_load_file(again.ctx, str(state_path).encode(), buf, len(buf), ctypes.byref(count))
    again.input_ids[: count.value] = list(buf[: count.value])
    again.n_tokens = count.value
    out["restart_load_s"] = time.perf_counter() - started
    out["doc_restart_ttft_s"] = ask(again, QUESTIONS[2])
    return out


def _doc_ids(args: argparse.Namespace) -> list[int]:
    from flashmemory.model.tokenizer import Tokenizer
    from flashmemory.model.default_model import default_model_path
    from flashmemory.model.loader import open_checkpoint

    checkpoint = open_checkpoint(args.model or default_model_path())
    tokenizer = Tokenizer.from_checkpoint(checkpoint.path, checkpoint.config.eos_token_ids)
    return tokenizer.encode(Path(args.text).read_text(encoding="utf-8", errors="replace"))[: args.doc_tokens]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["fm", "llamacpp"], help="run one engine here (internal)")
    ap.add_argument("--model", default=None, help="GGUF (default: the embedded SmolLM2)")
    ap.add_argument("--text", default=str(TEXT))
    ap.add_argument("--doc-tokens", type=int, default=8000)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--chat-doc-tokens", type=int, default=2000, help="document tokens in the second chat's system prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.engine:
        print(json.dumps(_fm(args) if args.engine == "fm" else _llamacpp(args)))
        return 0
    results, load = [], []
    for engine in ("fm", "llamacpp"):
        env = dict(os.environ)
        if engine == "fm":
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        else:
            env.pop("OMP_WAIT_POLICY", None)
        cmd = [sys.executable, __file__, "--engine", engine, "--doc-tokens", str(args.doc_tokens), "--text", args.text,
               "--new-tokens", str(args.new_tokens), "--threads", str(args.threads),
               "--chat-doc-tokens", str(args.chat_doc_tokens)] + (["--model", args.model] if args.model else [])
        load.append(os.getloadavg())
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{engine} failed: {proc.stderr[-2000:]}", file=sys.stderr)
            continue
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    _print(results, args)
    if args.json:
        args.json.write_text(json.dumps({"doc_tokens": args.doc_tokens, "threads": args.threads,
                                         "load_average_at_start": load, "results": results}, indent=2))
    return 0


def _print(results: list[dict], args: argparse.Namespace) -> None:
    print(f"\n{args.doc_tokens}-token document, {args.new_tokens} new tokens, {args.threads} threads\n")
    print("| engine | 1st question TTFT s | 2nd question TTFT s | 2nd / 1st | after restart TTFT s | restart / 1st | "
          "cache on disk MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        first, second = r["doc_on_ttft_s"]
        print(f"| {r['engine']} | {first:.2f} | {second:.2f} | {second / first:.1%} | {r['doc_restart_ttft_s']:.2f} | "
              f"{r['doc_restart_ttft_s'] / first:.1%} | {r['cache_file_bytes'] / 2**20:.1f} |")
    for r in results:
        for kind, label in (("chat", "8-turn chat"), ("doc_chat", f"8-turn chat about {args.chat_doc_tokens} tokens")):
            if f"{kind}_on" not in r:
                continue
            off, on = r[f"{kind}_off"], r[f"{kind}_on"]
            same = sum(a == b for a, b in zip(off["answers"], on["answers"]))
            print(f"\n{r['engine']} {label}: {off['total_s']:.1f} s recomputing vs {on['total_s']:.1f} s with the "
                  f"prefix cache ({on['total_s'] / off['total_s']:.0%}); TTFT summed {sum(off['ttft_s']):.1f} vs "
                  f"{sum(on['ttft_s']):.1f} s; the same greedy answer in {same}/{len(TURNS)} turns")
        if "answers" in r:
            same_doc = sum(a == b for a, b in zip(r["answers"]["off"], r["answers"]["on"]))
            print(f"same greedy text with the cache as without: document questions {same_doc}/{len(QUESTIONS)} "
                  "(the third after the restart)")


if __name__ == "__main__":
    sys.exit(main())
