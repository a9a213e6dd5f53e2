"""Jobs the benchmark hands to worker processes, and the figures they hand back (JSON both ways)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class SpeedJob:
    """One measurement: prefill `prompt_tokens` of the text, then decode `decode_tokens` greedily."""

    engine: str
    family: str
    settings: dict[str, Any]  # the engine's settings (FlashMemory knobs, transformers cache, llama.cpp KV type)
    folder: str  # safetensors folder (torch engines)
    gguf_path: str | None  # GGUF (llama.cpp)
    ids_path: str  # JSON list of the text's token ids
    prompt_tokens: int
    decode_tokens: int
    dtype: str
    num_threads: int
    kind: str = "speed"


@dataclass
class FidelityJob:
    """Score the first `context_tokens` of the text with every engine listed, the last `teacher_forced_tokens`
    fed one at a time; compare each engine's next-token distributions with the reference."""

    family: str
    engines: list[tuple[str, dict[str, Any]]]  # (name, settings)
    folder: str
    gguf_path: str | None
    ids_path: str
    context_tokens: int
    teacher_forced_tokens: int
    dtype: str
    num_threads: int
    reference_path: str  # torch file of the reference's decode log-softmax rows (written by the FlashMemory job)
    kind: str = "fidelity"


@dataclass
class SpeedResult:
    """Figures of one measurement (bytes of KV at the end of the request)."""

    engine: str
    prompt_tokens: int
    num_generated_tokens: int
    prefill_tok_s: float
    ttft_s: float
    decode_tok_s: float
    peak_rss_bytes: int
    device_kv_bytes: int  # KV memory the engine holds on its device (allocated: an arena or buffer counts whole)
    device_kv_bytes_used: int  # of which tokens' KV
    host_kv_bytes: int = 0  # FlashMemory L1 (or an offloaded cache's host copy)
    disk_kv_bytes: int = 0  # FlashMemory L2
    num_threads: int = 0
    device: str = "cpu"
    detail: dict[str, Any] = field(default_factory=dict)
    prefetch: dict[str, Any] | None = None  # PrefetchFigures of the request (FlashMemory with a prefetcher)


@dataclass
class FidelityResult:
    """Fidelity of one engine against the reference over the teacher-forced tokens."""

    engine: str
    decode_ppl: float
    mean_kl: float
    top1_agreement: float
    reference: str  # the engine whose distributions are the reference
    prefill_ppl: float | None = None
    device_kv_bytes: int | None = None
    error: str | None = None


def write_job(job: SpeedJob | FidelityJob, path: Path) -> Path:
    path.write_text(json.dumps(asdict(job)))
    return path


def read_job(path: Path) -> SpeedJob | FidelityJob:
    data = json.loads(path.read_text())
    if data.get("kind") == "fidelity":
        data["engines"] = [tuple(e) for e in data["engines"]]
        return FidelityJob(**data)
    return SpeedJob(**data)


def read_token_ids(path: str, count: int) -> list[int]:
    ids = json.loads(Path(path).read_text())
    if len(ids) < count:
        raise ValueError(f"the text has {len(ids)} tokens; {count} are needed")
    return ids[:count]
