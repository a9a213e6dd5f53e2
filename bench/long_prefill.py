"""One long prefill of the 32K model in a fresh process: wall time, tokens/s and peak RSS (a one-off measurement).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/long_prefill.py --tokens 8192 --kv-cache contiguous

Scores the first --tokens tokens of ../shared/data/lcet10.txt with `engine.score_tokens(ids, num_teacher_forced=4)`
(prefill in chunks, log-probs of every position, the last 4 tokens decoded one at a time); `--mode prefill`
runs generation's prefill instead (logits of the last token only, as `generate` does). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashmemory import FlashMemoryEngine  # noqa: E402
from flashmemory.model.long_model import long_model_path  # noqa: E402

TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "lcet10.txt"


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--kv-cache", choices=["contiguous", "tiered"], default="tiered")
    ap.add_argument("--mode", choices=["score", "prefill"], default="score")
    ap.add_argument("--model", default=None, help="default: the long model (long_model_path())")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--text", default=str(TEXT))
    args = ap.parse_args()
    engine = FlashMemoryEngine(model_path=args.model or str(long_model_path()), kv_cache=args.kv_cache,
                               num_threads=args.threads)
    rss_loaded = peak_rss_mib()
    text = Path(args.text).read_text(encoding="utf-8", errors="replace")
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < args.tokens:  # lcet10 is ~100K tokens; repeat a shorter text
        ids = ids + ids
    ids = ids[: args.tokens]
    started = time.perf_counter()
    if args.mode == "score":
        result = engine.score_tokens(ids, num_teacher_forced=4)
        extra = {"mean_nll": round(-result.token_logprobs.mean().item(), 4)}
    else:
        engine.generate_token_ids(ids[:-1], max_new_tokens=1)
        extra = {}
    seconds = time.perf_counter() - started
    engine.close()
    import torch

    print(json.dumps({
        "tokens": args.tokens, "kv_cache": args.kv_cache, "mode": args.mode, "seconds": round(seconds, 1),
        "tokens_per_s": round(args.tokens / seconds, 1), "peak_rss_mib": round(peak_rss_mib()),
        "rss_after_load_mib": round(rss_loaded), "load_s": round(engine.load_seconds, 1),
        "threads": torch.get_num_threads(), **extra,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
