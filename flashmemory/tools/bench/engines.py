"""The engines `flashmemory bench` compares: FlashMemory's KV configurations and its peers, and why one is n/a."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

from flashmemory.errors import ConfigError

FLASHMEMORY = "flashmemory"
TRANSFORMERS = "transformers"
LLAMA_CPP = "llama.cpp"
FAMILIES = (FLASHMEMORY, TRANSFORMERS, LLAMA_CPP)

LLAMA_CPP_HINT = "llama-cpp-python not installed (bash scripts/install_llama_cpp.sh, a 10-20 min build)"


@dataclass
class EngineSpec:
    """One engine configuration: its family, the settings that define it, and what it needs to run."""

    name: str
    family: str  # FLASHMEMORY | TRANSFORMERS | LLAMA_CPP
    description: str  # one line for the table's legend
    settings: dict[str, Any] = field(default_factory=dict)  # family-specific (engine knobs, cache kind, KV type)
    requires_modules: tuple[str, ...] = ()  # importable modules it needs
    install_hint: str = ""  # what to install when a module is missing
    needs_cuda: bool = False
    cuda_why: str = ""  # what needs the GPU (the n/a reason on a CPU-only host)
    extra: str = "bench"  # the optional extra that installs requires_modules
    budgeted: bool = False  # FlashMemory under a device budget too small for an FP16 cache of the length
    in_default_set: bool = True  # run when no engine is named (False: only when named)
    # FlashMemory with about this fraction of each prompt's KV on the disk level (L2): window and warm span sized
    # per length (disk_tier.py); 0 = the settings as given.
    disk_fraction: float = 0.0


REFERENCE_ENGINE = "fm-exact"  # the exact cache every torch engine's fidelity is measured against

# FlashMemory engines serve one sequence here (max_num_seqs=1), so the device arena is sized for one, as the
# peers' caches are.
_FM_COMMON = {"max_num_seqs": 1}
# The disk engines: half of each prompt's KV on L2, every L2 read a real disk read (the page cache is dropped after
# it), so decode with and without prefetch can be compared at every length. Named only (not in the default set):
# at 8K each adds about as much time as fm-mixed.
_DISK_FRACTION = 0.5
_FM_DISK = {"kv_cache": "tiered", "kv_precision": "mixed", "cold_zone_uncached_reads": True, **_FM_COMMON}
PREFETCH_BASELINE_ENGINE = "fm-mixed-disk"  # the disk engine without prefetch the prefetching ones compare with
# weights_dtype q8_0/q4_0 on a GPU (model/cuda_weights.py): fm-exact's KV, so fidelity against fm-exact is the
# weights' alone. device="cuda": never our CPU kernels under this name (those are what --decode-only compares).
_FM_CUDA_WEIGHTS = {"device": "cuda", "kv_cache": "contiguous", "kv_precision": "fp16", **_FM_COMMON}
_CUDA_WEIGHTS_WHY = ("torchao's int8/int4 weight-only kernels run on a GPU; on the CPU q8_0/q4_0 are our C kernels, "
                     "not this engine")
_HF_OFFLOAD_WHY = "transformers' offloaded caches copy KV between GPU and host"

ENGINES: tuple[EngineSpec, ...] = (
    EngineSpec("fm-exact", FLASHMEMORY, "FlashMemory, exact FP16 contiguous cache (the fidelity reference)",
               {"kv_cache": "contiguous", "kv_precision": "fp16", **_FM_COMMON}),
    EngineSpec("fm-exact-f32act", FLASHMEMORY, "fm-exact with decode_activations=float32: x not "
               "rounded to 8 bits in the decode GEMV (the float32-dequantized model's logits)",
               {"kv_cache": "contiguous", "kv_precision": "fp16", "decode_activations": "float32",
                **_FM_COMMON}, in_default_set=False),
    EngineSpec("fm-exact-int8act", FLASHMEMORY, "fm-exact with decode_activations=int8: x rounded "
               "to 8 bits for every block format (auto rounds it where the float path dequantizes)",
               {"kv_cache": "contiguous", "kv_precision": "fp16", "decode_activations": "int8",
                **_FM_COMMON}, in_default_set=False),
    EngineSpec("fm-contiguous", FLASHMEMORY, "FlashMemory, exact contiguous cache in the model dtype (the engine "
               "bench/bench_runner.py compares with transformers)", {"kv_cache": "contiguous", **_FM_COMMON},
               in_default_set=False),
    EngineSpec("fm-int2-disk", FLASHMEMORY, "FlashMemory tiered, kv_precision=int2-disk (INT4 L0 / "
               "FP16 L1 / INT2 L2: the seeds' hierarchy, the defaults until INT4 on L2), Quest "
               "selection",
               {"kv_cache": "tiered", "kv_precision": "int2-disk", **_FM_COMMON}),
    EngineSpec("fm-mixed", FLASHMEMORY, "FlashMemory tiered, kv_precision=mixed (INT4 L0 / FP16 L1 / "
               "INT4 L2), Quest selection (the defaults)", {"kv_cache": "tiered", "kv_precision": "mixed", **_FM_COMMON}),
    EngineSpec("fm-mixed-budget", FLASHMEMORY, "fm-mixed under max_gpu_memory_mb leaving the KV a quarter of "
               "the FP16 cache of the length (at most the fixed budget)",
               {"kv_cache": "tiered", "kv_precision": "mixed", **_FM_COMMON}, budgeted=True),
    EngineSpec(PREFETCH_BASELINE_ENGINE, FLASHMEMORY, "fm-mixed with half of the prompt's KV on the disk level (L2; "
               "window and warm span sized per length, 2048 + 2048 at 8K), uncached L2 reads, no prefetch",
               _FM_DISK, in_default_set=False, disk_fraction=_DISK_FRACTION),
    EngineSpec("fm-mixed-prefetch", FLASHMEMORY, "fm-mixed-disk plus the adaptive L2 prefetcher ranked by the heat "
               "predictor", {**_FM_DISK, "prefetch_strategy": "adaptive", "prefetch_ranker": "predictor"},
               in_default_set=False, disk_fraction=_DISK_FRACTION),
    EngineSpec("fm-mixed-prefetch-lru", FLASHMEMORY, "fm-mixed-disk plus the adaptive L2 prefetcher ranked by "
               "recency (LRU)", {**_FM_DISK, "prefetch_strategy": "adaptive", "prefetch_ranker": "lru"},
               in_default_set=False, disk_fraction=_DISK_FRACTION),
    EngineSpec("fm-cuda-int8", FLASHMEMORY, "fm-exact with weights_dtype=q8_0 on CUDA: torchao int8 per-row "
               "weight-only projections", {"weights_dtype": "q8_0", **_FM_CUDA_WEIGHTS}, ("torchao",),
               "torchao==0.18.0", needs_cuda=True, cuda_why=_CUDA_WEIGHTS_WHY, extra="cuda"),
    EngineSpec("fm-cuda-int4", FLASHMEMORY, "fm-exact with weights_dtype=q4_0 on CUDA: torchao int4 group-32 "
               "(tinygemm) weight-only projections", {"weights_dtype": "q4_0", **_FM_CUDA_WEIGHTS}, ("torchao",),
               "torchao==0.18.0", needs_cuda=True, cuda_why=_CUDA_WEIGHTS_WHY, extra="cuda"),
    EngineSpec("hf-dynamic", TRANSFORMERS, "transformers DynamicCache (model dtype)", {"cache": "dynamic"}),
    EngineSpec("hf-static", TRANSFORMERS, "transformers StaticCache (preallocated to prompt + decode)",
               {"cache": "static"}),
    EngineSpec("hf-quanto-int4", TRANSFORMERS, "transformers QuantizedCache, quanto backend, 4 bits",
               {"cache": "quantized", "backend": "quanto", "nbits": 4}, ("optimum.quanto",), "optimum-quanto"),
    EngineSpec("hf-quanto-int2", TRANSFORMERS, "transformers QuantizedCache, quanto backend, 2 bits",
               {"cache": "quantized", "backend": "quanto", "nbits": 2}, ("optimum.quanto",), "optimum-quanto"),
    # axis 1 for HQQ as in transformers' KV-cache documentation.
    EngineSpec("hf-hqq-int4", TRANSFORMERS, "transformers QuantizedCache, HQQ backend, 4 bits",
               {"cache": "quantized", "backend": "hqq", "nbits": 4, "axis": 1}, ("hqq",), "hqq"),
    EngineSpec("hf-hqq-int2", TRANSFORMERS, "transformers QuantizedCache, HQQ backend, 2 bits",
               {"cache": "quantized", "backend": "hqq", "nbits": 2, "axis": 1}, ("hqq",), "hqq"),
    EngineSpec("hf-offloaded", TRANSFORMERS, "transformers DynamicCache(offloading=True)",
               {"cache": "dynamic", "offloading": True}, needs_cuda=True, cuda_why=_HF_OFFLOAD_WHY),
    EngineSpec("hf-offloaded-static", TRANSFORMERS, "transformers StaticCache(offloading=True)",
               {"cache": "static", "offloading": True}, needs_cuda=True, cuda_why=_HF_OFFLOAD_WHY),
    *(
        EngineSpec(f"llamacpp-{kv}{'-fa' if fa else ''}", LLAMA_CPP,
                   f"llama.cpp (llama-cpp-python), {kv} KV, flash attention {'on' if fa else 'off'}",
                   {"kv_type": kv, "flash_attn": fa}, ("llama_cpp",), LLAMA_CPP_HINT)
        for kv in ("f16", "q8_0", "q4_0") for fa in (False, True)
    ),
)
ENGINE_NAMES = tuple(e.name for e in ENGINES)


def select_engines(names: tuple[str, ...] | list[str]) -> list[EngineSpec]:
    """Engines by name, or by family (flashmemory, transformers, llama.cpp); empty = the default set. Order is
    ENGINES'."""
    if not names:
        return [e for e in ENGINES if e.in_default_set]
    wanted: set[str] = set()
    for name in names:
        if name in FAMILIES:
            wanted.update(e.name for e in ENGINES if e.family == name and e.in_default_set)
        elif name in ENGINE_NAMES:
            wanted.add(name)
        else:
            raise ConfigError(f"unknown engine {name!r}; valid: {', '.join(ENGINE_NAMES)}, or a family: "
                              f"{', '.join(FAMILIES)}")
    return [e for e in ENGINES if e.name in wanted]


def unavailable_reason(spec: EngineSpec, has_gguf: bool, cuda_available: bool) -> str | None:
    """Why this engine cannot run here ("n/a: ..."), or None when it can. No GPU comes first: installing a module
    would not make a CUDA engine run here."""
    if spec.needs_cuda and not cuda_available:
        return f"n/a: needs CUDA, no CUDA device here ({spec.cuda_why})"
    missing = [m for m in spec.requires_modules if not _importable(m)]
    if missing:
        if spec.family == LLAMA_CPP:
            return f"n/a: {spec.install_hint}"
        return f"n/a: pip install {spec.install_hint} (optional extra: pip install 'flashmemory-runtime[{spec.extra}]')"
    if spec.family == LLAMA_CPP and not has_gguf:
        return "n/a: llama.cpp needs a GGUF model (the model given is a safetensors folder)"
    return None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package of a dotted name
        return False
