"""ModelConfig: the architecture hyper-parameters our decoder needs, read from HF config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flashmemory.errors import UnsupportedModelError
from flashmemory.model.registry import BY_GGUF_NAME, BY_HF_NAME

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass
class ModelConfig:
    """Hyper-parameters of one Llama-family checkpoint."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (grouped-query attention when < num_heads)
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int  # the longest context the checkpoint was configured for, in tokens
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None  # HF rope_scaling / rope_parameters, rope_type != "default"
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False  # q and k RMS-normed per head (head_dim weights each) before RoPE
    fused_projections: bool = False  # the files hold qkv_proj and gate_up_proj whole (Phi-3)
    sliding_window_tokens: int | None = None  # Mistral-style local attention span; None = full attention
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}; the checkpoint's config is inconsistent"
            )
        if self.head_dim % 2 != 0:
            raise UnsupportedModelError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )

    @property
    def max_context_tokens(self) -> int:
        """The longest context the checkpoint supports, counting rope scaling as vLLM does."""
        scaling = self.rope_scaling or {}
        rope_type, factor = scaling.get("rope_type", "default"), scaling.get("factor") or 1.0
        if rope_type in ("linear", "dynamic"):
            return int(self.max_position_embeddings * factor)
        if rope_type == "yarn":
            original = scaling.get("original_max_position_embeddings", self.max_position_embeddings)
            return max(self.max_position_embeddings, int(original * factor))
        return self.max_position_embeddings  # llama3 configs already state the extended length

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def num_parameters(self) -> int:
        """Parameters of our decoder for this config (tied embeddings counted once)."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h + ((q + 2 * kv) if self.qkv_bias else 0)
        per_layer += 2 * self.head_dim if self.qk_norm else 0
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * per_layer + h

    def kv_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        """Bytes one token's keys and values take over all layers (2 bytes/element = fp16)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in BY_HF_NAME), None)
        if arch is None:
            raise UnsupportedModelError(
                f"architecture {archs or cfg.get('model_type')!r} is not supported; "
                f"supported: {', '.join(BY_HF_NAME)}"
            )
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=true is not supported by the Llama-family runner")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope_theta, rope_scaling = _hf_rope(cfg)
        sliding = cfg.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
            sliding = None
        eos = cfg.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=BY_HF_NAME[arch].qkv_bias or bool(cfg.get("attention_bias", False)),
            qk_norm=BY_HF_NAME[arch].qk_norm,
            fused_projections=BY_HF_NAME[arch].fused,
            sliding_window_tokens=int(sliding) if sliding else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None],
            name=str(cfg.get("_name_or_path", "")),
        )

    @classmethod
    def from_gguf_metadata(
        cls,
        meta: dict[str, Any],
        *,
        has_output_weight: bool,
        has_qkv_bias: bool,
        num_token_strings: int | None = None,
        embedding_rows: int | None = None,
    ) -> "ModelConfig":
        """Config from GGUF metadata; `num_token_strings` is the length of tokenizer.ggml.tokens (the reader
        skips its contents) and `embedding_rows` the embedding tensor's row count."""
        gguf_arch = meta.get("general.architecture")
        if gguf_arch not in BY_GGUF_NAME:
            raise UnsupportedModelError(
                f"GGUF architecture {gguf_arch!r} is not supported; supported: {', '.join(BY_GGUF_NAME)}"
            )
        p = f"{gguf_arch}."
        hidden = int(meta[p + "embedding_length"])
        num_heads = int(meta[p + "attention.head_count"])
        rope_scaling = None
        scaling_type = meta.get(p + "rope.scaling.type")
        if scaling_type and scaling_type != "none":
            rope_scaling = {"rope_type": scaling_type, "factor": float(meta[p + "rope.scaling.factor"])}
            if (orig := meta.get(p + "rope.scaling.original_context_length")) is not None:
                rope_scaling["original_max_position_embeddings"] = int(orig)
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            architecture=BY_GGUF_NAME[gguf_arch].hf_name,
            vocab_size=_gguf_vocab_size(meta, p, num_token_strings, embedding_rows),
            hidden_size=hidden,
            intermediate_size=int(meta[p + "feed_forward_length"]),
            num_layers=int(meta[p + "block_count"]),
            num_heads=num_heads,
            num_kv_heads=int(meta.get(p + "attention.head_count_kv") or num_heads),
            head_dim=int(meta.get(p + "attention.key_length") or hidden // num_heads),
            rms_norm_eps=float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
            max_position_embeddings=int(meta.get(p + "context_length", 2048)),
            rope_theta=float(meta.get(p + "rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            tie_word_embeddings=not has_output_weight,
            qkv_bias=has_qkv_bias,
            qk_norm=BY_GGUF_NAME[gguf_arch].qk_norm,
            fused_projections=BY_GGUF_NAME[gguf_arch].fused,
            sliding_window_tokens=None,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[int(eos)] if eos is not None else [],
            name=str(meta.get("general.name", "")),
        )


def _gguf_vocab_size(
    meta: dict[str, Any], prefix: str, num_token_strings: int | None, embedding_rows: int | None
) -> int:
    """As llama.cpp: the stated vocab_size, else the token list's length; else the embedding's rows."""
    size = meta.get(prefix + "vocab_size") or num_token_strings or embedding_rows
    if not size:
        raise UnsupportedModelError(
            f"the GGUF states no {prefix}vocab_size, has no tokenizer.ggml.tokens and no token_embd tensor; "
            "the file is incomplete: convert the model again with llama.cpp's convert_hf_to_gguf.py"
        )
    return int(size)


def _hf_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Read rope theta and scaling from either the transformers<5 or the >=5 config layout."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = merged.pop("rope_type", merged.pop("type", "default"))
    merged.pop("type", None)
    if rope_type == "default":
        return theta, None
    if rope_type in ("llama3", "yarn"):
        merged.setdefault(
            "original_max_position_embeddings",
            cfg.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 2048)),
        )
    return theta, {"rope_type": rope_type, **merged}
