"""Worker process entry: `python -m flashmemory.tools.bench.worker JOB.json` runs one job and prints one JSON line.

One process per measurement, so peak RSS belongs to one engine and no engine inherits another's allocations.
The line is {"ok": true, "result": ...} or {"ok": false, "error": "..."} for an error the engine raised; a
crash (killed for memory, a segfault in a native library) shows as a non-zero exit without that line.
"""

from __future__ import annotations

import json
import sys
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

from flashmemory.tools.bench.engines import FLASHMEMORY, LLAMA_CPP, TRANSFORMERS
from flashmemory.tools.bench.jobs import FidelityJob, SpeedJob, read_job

RESULT_PREFIX = "BENCH-RESULT "  # marks the result line among anything a library prints to stdout


def run_job(job: SpeedJob | FidelityJob) -> Any:
    if job.family == FLASHMEMORY:
        from flashmemory.tools.bench import fm_worker as worker
    elif job.family == TRANSFORMERS:
        from flashmemory.tools.bench import hf_worker as worker
    elif job.family == LLAMA_CPP:
        from flashmemory.tools.bench import llamacpp_worker as worker
    else:
        raise ValueError(f"unknown engine family {job.family!r}")
    if isinstance(job, FidelityJob):
        return [asdict(r) for r in worker.measure_fidelity(job)]
    if job.family == LLAMA_CPP:
        # The model's shape from the folder's config.json, without torch: this process holds llama.cpp only.
        from flashmemory.model.model_config import ModelConfig

        cfg = ModelConfig.from_hf_dict(json.loads((Path(job.folder) / "config.json").read_text()))
        return asdict(worker.measure_speed(job, cfg.num_layers, cfg.num_kv_heads * cfg.head_dim))
    return asdict(worker.measure_speed(job))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m flashmemory.tools.bench.worker JOB.json", file=sys.stderr)
        return 2
    job = read_job(Path(args[0]))
    try:
        payload = {"ok": True, "result": run_job(job)}
    except Exception as e:  # noqa: BLE001 - reported to the parent as this engine's reason, not a crash
        traceback.print_exc(file=sys.stderr)
        payload = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    sys.stdout.write(RESULT_PREFIX + json.dumps(payload) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
