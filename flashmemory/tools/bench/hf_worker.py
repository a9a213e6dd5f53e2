"""Hugging Face transformers in a worker process: the same weights with its own caches (dynamic, static,
quantized, offloaded), timed through `generate` and scored token by token for fidelity."""

from __future__ import annotations

import time
from typing import Any

import torch

from flashmemory.tools.bench.engines import REFERENCE_ENGINE
from flashmemory.tools.bench.fm_worker import WARMUP_PROMPT_TOKENS, peak_rss_bytes
from flashmemory.tools.bench.jobs import FidelityJob, FidelityResult, SpeedJob, SpeedResult, read_token_ids
from flashmemory.tools.bench.kv_bytes import tensor_bytes_by_device


def load_model(folder: str, dtype: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(device).eval()
    return model, tokenizer


def cache_kwarg(model, cache) -> dict[str, Any]:
    """The keyword that hands a cache to transformers: `cache` from 5.x on, `past_key_values` before."""
    import inspect

    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}


def make_cache(model, settings: dict[str, Any], max_cache_tokens: int):
    """A fresh cache of the kind the engine settings name."""
    from transformers.cache_utils import DynamicCache, QuantizedCache, StaticCache

    kind = settings["cache"]
    offloading = bool(settings.get("offloading", False))
    if kind == "dynamic":
        return DynamicCache(config=model.config, offloading=offloading)
    if kind == "static":
        return StaticCache(config=model.config, max_cache_len=max_cache_tokens, offloading=offloading)
    if kind == "quantized":
        axis = settings.get("axis", 0)
        return QuantizedCache(settings["backend"], model.config, nbits=settings["nbits"], axis_key=axis,
                              axis_value=axis)
    raise ValueError(f"unknown transformers cache kind {kind!r}")


HQQ_GROUP_VALUES = 64  # transformers' QuantizedCache default q_group_size


def explain_failure(error: RuntimeError, settings: dict[str, Any], model, num_tokens: int) -> RuntimeError:
    """A clearer reason for a known peer failure: HQQ's bit packing needs whole bytes of groups."""
    if settings.get("backend") != "hqq" or "must match the size" not in str(error):
        return error
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    codes_per_byte = 8 // settings["nbits"]
    groups = cfg.num_key_value_heads * num_tokens * head_dim / HQQ_GROUP_VALUES
    return RuntimeError(
        f"{error} -- HQQ packs {codes_per_byte} {settings['nbits']}-bit codes per byte and fails unless the number "
        f"of {HQQ_GROUP_VALUES}-value groups (KV heads x tokens x head_dim / {HQQ_GROUP_VALUES} = {groups:g} for "
        f"{num_tokens} tokens) is a multiple of {codes_per_byte}"
    )


def _cache_bytes(cache, model_device: torch.device) -> dict[str, int]:
    by_device = tensor_bytes_by_device(cache.layers)
    device = by_device.get(model_device.type, 0)
    host = by_device.get("cpu", 0) if model_device.type != "cpu" else 0
    return {"device": device, "host": host}


def measure_speed(job: SpeedJob) -> SpeedResult:
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(job.num_threads)
    model, tokenizer = load_model(job.folder, job.dtype)
    device = model.device
    ids = read_token_ids(job.ids_path, job.prompt_tokens)

    class Clock(BaseStreamer):
        """Records when generate hands out each token: #0 is the prompt, #1 the first generated token."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:
            if device.type == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    def run(num_prompt: int, num_new: int):
        cache = make_cache(model, job.settings, num_prompt + num_new)
        clock = Clock()
        prompt = torch.tensor([ids[:num_prompt]], device=device)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(prompt, **cache_kwarg(model, cache), max_new_tokens=num_new, min_new_tokens=num_new,
                           do_sample=False, streamer=clock, pad_token_id=tokenizer.eos_token_id)
        return clock.times[1] - start, clock.times[-1] - clock.times[1], len(clock.times) - 1, cache

    try:
        run(min(WARMUP_PROMPT_TOKENS, len(ids)), 2)
        prefill_s, decode_s, generated, cache = run(len(ids), job.decode_tokens)
    except RuntimeError as e:
        raise explain_failure(e, job.settings, model, len(ids)) from e
    total_tokens = cache.get_seq_length()
    kv = _cache_bytes(cache, device)
    return SpeedResult(
        engine=job.engine, prompt_tokens=len(ids), num_generated_tokens=generated,
        prefill_tok_s=len(ids) / prefill_s, ttft_s=prefill_s,
        decode_tok_s=(generated - 1) / decode_s if generated > 1 and decode_s > 0 else 0.0,
        peak_rss_bytes=peak_rss_bytes(), device_kv_bytes=kv["device"], device_kv_bytes_used=kv["device"],
        host_kv_bytes=kv["host"], num_threads=torch.get_num_threads(), device=str(device),
        detail={"cache_class": type(cache).__name__, "cache_tokens": int(total_tokens)},
    )


def score(model, settings: dict[str, Any], ids: list[int], teacher_forced: int) -> torch.Tensor:
    """Decode log-softmax rows [teacher_forced - 1, vocab]: the prefix in one forward, then one token at a time
    (the positions FlashMemoryEngine.score_tokens reports, so the rows compare one to one)."""
    device = model.device
    n_prefill = len(ids) - teacher_forced
    cache = make_cache(model, settings, len(ids))
    rows = []
    with torch.inference_mode():
        model(torch.tensor([ids[:n_prefill]], device=device), **cache_kwarg(model, cache), use_cache=True,
              logits_to_keep=1)
        for pos in range(n_prefill, len(ids) - 1):
            out = model(torch.tensor([[ids[pos]]], device=device), **cache_kwarg(model, cache), use_cache=True)
            rows.append(torch.log_softmax(out.logits[0, -1].float(), dim=-1).cpu())
    return torch.stack(rows)


def measure_fidelity(job: FidelityJob) -> list[FidelityResult]:
    from flashmemory.tools.eval import compare_distributions, perplexity

    torch.set_num_threads(job.num_threads)
    model, _ = load_model(job.folder, job.dtype)
    ids = read_token_ids(job.ids_path, job.context_tokens)
    reference = torch.load(job.reference_path)
    forced = torch.tensor(ids[len(ids) - job.teacher_forced_tokens + 1:])  # the tokens each row predicts
    results = []
    for name, settings in job.engines:
        try:
            try:
                dist = score(model, settings, ids, job.teacher_forced_tokens)
            except RuntimeError as e:
                raise explain_failure(e, settings, model, len(ids) - job.teacher_forced_tokens) from e
        except Exception as e:  # noqa: BLE001 - one cache failing must not hide the others
            results.append(FidelityResult(name, 0.0, 0.0, 0.0, REFERENCE_ENGINE, error=f"{type(e).__name__}: {e}"))
            continue
        mean_kl, top1 = compare_distributions(reference, dist)
        decode_ppl = perplexity(dist.gather(1, forced[:, None])[:, 0])
        results.append(FidelityResult(name, decode_ppl, mean_kl, top1, REFERENCE_ENGINE))
    return results
