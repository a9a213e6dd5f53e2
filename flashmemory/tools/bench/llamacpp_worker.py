"""llama.cpp (through llama-cpp-python) in a worker process: the GGUF itself, with f16 / q8_0 / q4_0 KV and
flash attention on or off, fed the same token ids as the other engines."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from flashmemory.errors import ConfigError
from flashmemory.tools.bench.jobs import FidelityJob, FidelityResult, SpeedJob, SpeedResult, read_token_ids
from flashmemory.tools.bench.kv_bytes import llama_cpp_kv_bytes
from flashmemory.tools.bench.llamacpp_open import open_llama
from flashmemory.rss import peak_rss_bytes

REFERENCE = "llamacpp-f16"  # llama.cpp's rows are compared with its own f16 cache (its kernels, its weights)
WARMUP_PROMPT_TOKENS = 16
SLACK_CELLS = 16  # KV cells beyond prompt + decode (llama.cpp rounds n_ctx up anyway)


class LlamaCppError(RuntimeError):
    """llama.cpp refused a configuration (e.g. a quantized V cache without flash attention)."""


def _ggml_type(llama_cpp, name: str) -> int:
    return {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}[name]


def open_model(gguf_path: str, settings: dict[str, Any], n_ctx: int, num_threads: int):
    import llama_cpp

    kv = settings["kv_type"]
    try:
        return open_llama(
            model_path=gguf_path, n_ctx=n_ctx, n_batch=512, n_threads=num_threads, n_threads_batch=num_threads,
            type_k=_ggml_type(llama_cpp, kv), type_v=_ggml_type(llama_cpp, kv), flash_attn=settings["flash_attn"],
            logits_all=False, verbose=False,
        )
    except ConfigError:
        raise
    except (ValueError, RuntimeError) as e:
        hint = ("; llama.cpp needs flash attention for a quantized V cache"
                if kv != "f16" and not settings["flash_attn"] else "")
        raise LlamaCppError(f"llama.cpp could not create the context ({e}){hint}") from e


class _Session:
    """One Llama context fed token ids; last_logits() are the logits after the latest eval."""

    def __init__(self, llm) -> None:
        import llama_cpp

        self.llm = llm
        self._get_logits = llama_cpp.llama_get_logits_ith
        self.n_vocab = llm.n_vocab()

    def reset(self) -> None:
        self.llm.reset()  # the next eval removes every cell past n_tokens = 0

    def feed(self, ids: list[int]) -> np.ndarray:
        self.llm.eval(ids)
        return np.ctypeslib.as_array(self._get_logits(self.llm.ctx, -1), shape=(self.n_vocab,)).copy()


def measure_speed(job: SpeedJob, model_layers: int, kv_width: int) -> SpeedResult:
    if job.gguf_path is None:
        raise LlamaCppError("llama.cpp needs a GGUF model")
    ids = read_token_ids(job.ids_path, job.prompt_tokens)
    llm = open_model(job.gguf_path, job.settings, len(ids) + job.decode_tokens + SLACK_CELLS, job.num_threads)
    session = _Session(llm)
    session.feed(ids[:WARMUP_PROMPT_TOKENS])
    session.reset()
    start = time.perf_counter()
    token = int(session.feed(ids).argmax())
    first = time.perf_counter()
    for _ in range(job.decode_tokens - 1):
        token = int(session.feed([token]).argmax())
    end = time.perf_counter()
    n_ctx = llm.n_ctx()
    kv_bytes = llama_cpp_kv_bytes(job.settings["kv_type"], job.settings["kv_type"], n_ctx, model_layers, kv_width)
    llm.close()
    return SpeedResult(
        engine=job.engine, prompt_tokens=len(ids), num_generated_tokens=job.decode_tokens,
        prefill_tok_s=len(ids) / (first - start), ttft_s=first - start,
        decode_tok_s=(job.decode_tokens - 1) / (end - first) if end > first else 0.0,
        peak_rss_bytes=peak_rss_bytes(), device_kv_bytes=kv_bytes,
        device_kv_bytes_used=llama_cpp_kv_bytes(job.settings["kv_type"], job.settings["kv_type"],
                                                len(ids) + job.decode_tokens, model_layers, kv_width),
        num_threads=job.num_threads, device="cpu",
        detail={"n_ctx": n_ctx, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "")},
    )


def score(job: FidelityJob, settings: dict[str, Any]) -> np.ndarray:
    """Decode log-softmax rows [teacher_forced - 1, vocab], as FlashMemoryEngine.score_tokens reports them."""
    ids = read_token_ids(job.ids_path, job.context_tokens)
    n_prefill = len(ids) - job.teacher_forced_tokens
    llm = open_model(job.gguf_path or "", settings, len(ids) + SLACK_CELLS, job.num_threads)
    session = _Session(llm)
    session.feed(ids[:n_prefill])
    rows = []
    for pos in range(n_prefill, len(ids) - 1):
        logits = session.feed([ids[pos]]).astype(np.float64)
        rows.append(logits - np.logaddexp.reduce(logits))
    llm.close()
    return np.stack(rows)


def measure_fidelity(job: FidelityJob) -> list[FidelityResult]:
    import torch

    from flashmemory.tools.eval import compare_distributions, perplexity

    if job.gguf_path is None:
        raise LlamaCppError("llama.cpp needs a GGUF model")
    ids = read_token_ids(job.ids_path, job.context_tokens)
    forced = torch.tensor(ids[len(ids) - job.teacher_forced_tokens + 1:])
    reference = torch.from_numpy(score(job, {"kv_type": "f16", "flash_attn": False})).float()
    results = []
    for name, settings in job.engines:
        try:
            dist = torch.from_numpy(score(job, settings)).float()
        except LlamaCppError as e:
            results.append(FidelityResult(name, 0.0, 0.0, 0.0, REFERENCE, error=str(e)))
            continue
        mean_kl, top1 = compare_distributions(reference, dist)
        results.append(FidelityResult(name, perplexity(dist.gather(1, forced[:, None])[:, 0]), mean_kl, top1,
                                      REFERENCE))
    return results
