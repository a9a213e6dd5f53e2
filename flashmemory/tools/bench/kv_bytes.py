"""Counting the KV bytes an engine holds: tensors found in a cache object (per device), and llama.cpp's layout."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

# llama.cpp KV types: bytes per block of values and values per block (ggml's type traits).
GGML_KV_TYPES: dict[str, tuple[int, int]] = {"f32": (4, 1), "f16": (2, 1), "q8_0": (34, 32), "q4_0": (18, 32)}


def tensor_bytes_by_device(obj: Any) -> dict[str, int]:
    """Bytes of every tensor reachable from obj (attributes, containers, quantized-tensor parts), per device type.

    Quantized tensor subclasses (optimum-quanto) are opened through __tensor_flatten__, so their packed data,
    scales and shifts are counted, not their logical shape. A storage reached twice is counted once.
    """
    import torch  # here, not at the top: the llama.cpp worker imports this module and must not load torch

    totals: dict[str, int] = defaultdict(int)
    seen_storages: set[tuple[str, int]] = set()
    seen_objects: set[int] = set()

    def visit(x: Any, depth: int) -> None:
        if depth > 12 or id(x) in seen_objects:
            return
        seen_objects.add(id(x))
        if isinstance(x, torch.Tensor):
            flatten = getattr(type(x), "__tensor_flatten__", None)
            if flatten is not None and type(x) is not torch.Tensor and not isinstance(x, torch.nn.Parameter):
                names, _ = x.__tensor_flatten__()
                for name in names:
                    visit(getattr(x, name), depth + 1)
                return
            if x.numel() == 0:
                return
            storage = x.untyped_storage()
            key = (x.device.type, storage.data_ptr())
            if key not in seen_storages:
                seen_storages.add(key)
                totals[x.device.type] += storage.nbytes()
            return
        if isinstance(x, dict):
            for v in x.values():
                visit(v, depth + 1)
        elif isinstance(x, (list, tuple, set)):
            for v in x:
                visit(v, depth + 1)
        elif hasattr(x, "__dict__") and not isinstance(x, (type, torch.nn.Module)):
            for v in vars(x).values():
                visit(v, depth + 1)

    visit(obj, 0)
    return dict(totals)


def llama_cpp_kv_bytes(kv_type_k: str, kv_type_v: str, num_cells: int, num_layers: int, kv_width: int) -> int:
    """Bytes of llama.cpp's KV buffers: num_cells cells (n_ctx, allocated up front) of every layer's K and V rows,
    each kv_width = num_kv_heads * head_dim values stored in the given ggml type."""
    total = 0
    for kind in (kv_type_k, kv_type_v):
        block_bytes, block_values = GGML_KV_TYPES[kind]
        if kv_width % block_values:
            raise ValueError(f"KV row width {kv_width} is not a multiple of {kind}'s block of {block_values}")
        total += num_cells * num_layers * (kv_width // block_values) * block_bytes
    return total
