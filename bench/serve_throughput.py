"""Throughput of the OpenAI-compatible server for 1, 4 and 16 concurrent clients against the same server.

Starts `python -m flashmemory.serve` (or uses --url), then, for each concurrency level, runs that many clients at
once, each sending --requests-per-client streaming completions one after another (short prompts, --max-tokens
tokens each, ignore_eos so every request generates exactly that many). Reports generated tokens per second over
the level's wall time, requests per second, and median / p90 request latency and median time to first token:

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/serve_throughput.py --concurrency 1 4 16 --max-tokens 32

Extra arguments after `--` go to the server (e.g. `-- --kv-precision fp16 --max-num-seqs 32`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

PROMPTS = [
    "Write one sentence about the sea.",
    "The capital of France is",
    "List three colours:",
    "Once upon a time, in a small village,",
    "Explain what a cache is in one line.",
    "The quick brown fox",
    "My favourite fruit is",
    "In 1492, Columbus",
]


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    generated_tokens: int
    wall_s: float
    tokens_per_s: float
    requests_per_s: float
    latency_median_s: float
    latency_p90_s: float
    ttft_median_s: float


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """(latency, time to first token, completion tokens) of one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk["choices"] and first is None:
                first = time.perf_counter() - started
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return time.perf_counter() - started, first or 0.0, tokens


async def run_level(url: str, model: str, concurrency: int, per_client: int, max_tokens: int) -> LevelResult:
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def client_loop(i: int) -> list[tuple[float, float, int]]:
            return [await one_request(client, model, PROMPTS[(i * per_client + j) % len(PROMPTS)], max_tokens)
                    for j in range(per_client)]

        started = time.perf_counter()
        per_client_results = await asyncio.gather(*(client_loop(i) for i in range(concurrency)))
        wall = time.perf_counter() - started
    results = [r for rs in per_client_results for r in rs]
    latencies = sorted(r[0] for r in results)
    tokens = sum(r[2] for r in results)
    return LevelResult(
        concurrency=concurrency, requests=len(results), generated_tokens=tokens, wall_s=round(wall, 2),
        tokens_per_s=round(tokens / wall, 2), requests_per_s=round(len(results) / wall, 3),
        latency_median_s=round(statistics.median(latencies), 2),
        latency_p90_s=round(latencies[min(len(latencies) - 1, int(0.9 * len(latencies)))], 2),
        ttft_median_s=round(statistics.median(r[1] for r in results), 2),
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, server_args: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "flashmemory.serve", "--port", str(port), "--log-level", "warning",
           "--max-tokens-limit", str(max(args.max_tokens, 16))]
    if args.model:
        cmd.append(args.model)
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.Popen(cmd + server_args, cwd=Path(__file__).resolve().parents[1])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.terminate()
            raise SystemExit("the server did not become healthy within 300 s")
        time.sleep(0.5)


def main() -> int:
    argv = sys.argv[1:]
    server_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="benchmark a running server instead of starting one")
    ap.add_argument("--model", default=None, help="model for the started server (default: embedded SmolLM2)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the started server")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)

    load_before = os.getloadavg()[0]  # other work on the machine skews every number: record it
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args, server_args)
    try:
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        asyncio.run(one_request(httpx.AsyncClient(base_url=url, timeout=600), model, PROMPTS[0], 4))  # warm-up
        results = []
        for c in args.concurrency:
            result = asyncio.run(run_level(url, model, c, args.requests_per_client, args.max_tokens))
            results.append(result)
            print(f"concurrency {c:3d}: {result.tokens_per_s:7.2f} tok/s, {result.requests_per_s:.3f} req/s, "
                  f"latency median {result.latency_median_s:.2f} s (p90 {result.latency_p90_s:.2f}), "
                  f"TTFT median {result.ttft_median_s:.2f} s", file=sys.stderr, flush=True)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()

    load = (round(load_before, 2), round(os.getloadavg()[0], 2))
    print(f"\nmodel {model}, {args.max_tokens} tokens per request, {args.requests_per_client} requests per client, "
          f"{platform.machine()} {os.cpu_count()} CPUs, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '')}, "
          f"load average {load[0]} before / {load[1]} after\n")
    print("| clients | requests | tokens | wall s | tokens/s | requests/s | latency median s | latency p90 s "
          "| TTFT median s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r.concurrency} | {r.requests} | {r.generated_tokens} | {r.wall_s} | {r.tokens_per_s} | "
              f"{r.requests_per_s} | {r.latency_median_s} | {r.latency_p90_s} | {r.ttft_median_s} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": model, "max_tokens": args.max_tokens,
                                               "requests_per_client": args.requests_per_client,
                                               "server_args": server_args, "cpus": os.cpu_count(),
                                               "load_average_before_after": load,
                                               "results": [asdict(r) for r in results]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
