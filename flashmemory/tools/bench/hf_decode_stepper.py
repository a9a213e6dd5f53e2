"""transformers in the decode comparison (decode_worker.py): the same GGUF loaded by transformers (dequantized to
float32, as tests/model/test_parity_qwen2_long.py loads it) or an HF folder, decoding with a DynamicCache. With a
KV snapshot the cache is built from the snapshot's post-RoPE keys and values (transformers' Qwen2 and Llama
attention cache keys after RoPE, in the same rotate-half layout as ours), cast from FP16 to the model's float32.
torch and transformers are imported here only: the llama.cpp worker never loads this module."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from flashmemory.errors import ConfigError, KVSnapshotError
from flashmemory.tools.bench.decode_fidelity import log_softmax


class TransformersStepper:
    """A transformers causal LM and one DynamicCache, fed token ids one forward per feed."""

    def __init__(self, spec: dict[str, Any], num_ctx: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        settings = spec.get("settings", {})
        if settings.get("cache", "dynamic") != "dynamic" or settings.get("offloading"):
            raise ConfigError(f"the decode comparison runs transformers with a DynamicCache only, not {settings}")
        torch.set_num_threads(spec["threads"])
        path = Path(spec["gguf_path"])
        if path.suffix == ".gguf":  # transformers dequantizes every GGUF tensor to the dtype asked for
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        self.model = model.eval()
        self.num_ctx = num_ctx
        self.cache: Any = None
        self._logits: Any = None  # [vocab] float32 of the latest feed

    def _new_cache(self):
        from transformers.cache_utils import DynamicCache

        return DynamicCache(config=self.model.config)

    def _run(self, cache, ids: list[int]):
        import torch

        from flashmemory.tools.bench.hf_worker import cache_kwarg

        with torch.inference_mode():
            out = self.model(torch.tensor([ids]), **cache_kwarg(self.model, cache), use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

    def warm_up(self, ids: list[int]) -> None:
        cache = self._new_cache()
        self._run(cache, ids)
        self._run(cache, ids[:1])

    def open(self) -> None:
        self.cache = self._new_cache()

    def feed(self, ids: list[int]) -> None:
        self._logits = self._run(self.cache, ids)

    def last_logprobs(self) -> np.ndarray:
        return log_softmax(self._logits.float().cpu().numpy())

    def restore(self, snapshot: Path, context_ids: list[int], num_tokens: int) -> None:
        """The snapshot's KV of the first num_tokens, layer by layer into the DynamicCache at positions 0..n-1: the
        next feed's positions (and its causal mask) start at n, from the cache's length."""
        import torch

        from flashmemory.tools.bench.llamacpp_state import read_snapshot_kv

        # [num_layers, num_kv_heads, n, head_dim]
        _, keys, values = read_snapshot_kv(snapshot, num_tokens, expected_ids=context_ids[:num_tokens])
        config = self.model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        expected = (config.num_hidden_layers, config.num_key_value_heads, num_tokens, head_dim)
        if keys.shape != expected:
            raise KVSnapshotError(f"{snapshot} holds KV of shape {keys.shape}, transformers' model needs {expected}")
        dtype = self.model.dtype
        for layer in range(keys.shape[0]):
            k = torch.from_numpy(np.ascontiguousarray(keys[layer])).to(dtype)[None]  # [1, heads, n, head_dim]
            v = torch.from_numpy(np.ascontiguousarray(values[layer])).to(dtype)[None]
            self.cache.update(k, v, layer)
        if self.cache.get_seq_length() != num_tokens:
            raise KVSnapshotError(f"the DynamicCache holds {self.cache.get_seq_length()} tokens after restoring "
                                  f"{num_tokens}")

    def kv_bytes(self) -> dict[str, int]:
        """The DynamicCache's tensors, counted per device (on a CPU run the model's device is the CPU)."""
        from flashmemory.tools.bench.kv_bytes import tensor_bytes_by_device

        counted = tensor_bytes_by_device(self.cache.layers)
        device = self.model.device.type
        return {"device": counted.get(device, 0), "host": counted.get("cpu", 0) if device != "cpu" else 0,
                "disk": 0}

    def close(self) -> None:
        self.cache = None
