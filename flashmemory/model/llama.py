"""Our Llama-family decoder (Llama 2/3.x, Mistral, Qwen2, SmolLM): RMSNorm, SwiGLU, GQA, RoPE; KV via KVCache."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from flashmemory.errors import CorruptWeightsError
from flashmemory.kvcache.interface import ForwardBatch, KVCache
from flashmemory.model.cuda_weights import tensor_bytes
from flashmemory.model.linear import DenseLinear, DequantWorkspace, QuantizedEmbedding, QuantizedLinear
from flashmemory.model.model_config import ModelConfig
from flashmemory.model.native import step_ops
from flashmemory.model.native.decode_layer import FusedDecodeLayer
from flashmemory.model.quantized import QuantizedTensor
from flashmemory.model.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as the reference implementations do."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = step_ops.rms_norm(x, self.weight, self.eps)  # one pass instead of eight ops (float32 CPU)
        if fused is not None:
            return fused
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query self-attention; q/k/v are one fused projection."""

    qkv_proj: DenseLinear | QuantizedLinear
    o_proj: DenseLinear | QuantizedLinear

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = DenseLinear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = DenseLinear(self.q_size, cfg.hidden_size, bias=False)
        # Qwen3: each head's q and k RMS-normed over head_dim before RoPE
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, batch: ForwardBatch
    ) -> torch.Tensor:
        # x: [T, hidden]
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q.contiguous())
            k = self.k_norm(k.contiguous())
        # keys are cached after RoPE; the fused kernel rotates q and k in place (their rows are fresh)
        if not step_ops.rope_(q, k, cos, sin):
            q = RotaryEmbedding.apply(q, cos, sin)
            k = RotaryEmbedding.apply(k, cos, sin)
        out = cache.attend(self.layer_idx, batch, q, k, v)  # [T, num_heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    """SwiGLU feed-forward; gate and up are one fused projection."""

    gate_up_proj: DenseLinear | QuantizedLinear
    down_proj: DenseLinear | QuantizedLinear

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = DenseLinear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = DenseLinear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        hidden = step_ops.swiglu(gate_up)  # fused on float32 CPU rows
        if hidden is None:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            hidden = F.silu(gate) * up
        return self.down_proj(hidden)


class DecoderLayer(nn.Module):
    """Pre-norm attention block then pre-norm MLP block, each with a residual. A decode step's few
    rows go through two native calls around the KV cache where the weights allow
    (native/decode_layer.py: the same bits as the per-op path); `fused_decode = False` on a layer
    keeps it per op."""

    fused_decode = True

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        # False: not looked at yet (the weights load after construction)
        self._fused: FusedDecodeLayer | None | bool = False

    def forward(self, x, cos, sin, cache: KVCache, batch: ForwardBatch) -> torch.Tensor:
        if self.fused_decode:
            if self._fused is False:
                self._fused = FusedDecodeLayer.build(self)
            fused = self._fused
            if fused is not None and fused.takes(x, cos, sin):
                q, k, v = fused.pre(x, cos, sin)
                return fused.post(x, cache.attend(self.self_attn.layer_idx, batch, q, k, v))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """The whole decoder: embeddings, layers, final norm and LM head (possibly tied to the embeddings)."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 weights_dtype: torch.dtype | None = None, decode_activations: str = "auto"):
        super().__init__()
        self.config = cfg
        self.device = torch.device(device)
        self.dtype = dtype  # activations
        self.weights_dtype = weights_dtype or dtype  # dense weights; block-format weights stay as stored
        # prefill tiles and decode rows of x for block-format weights
        self.workspace = DequantWorkspace(decode_activations)
        with torch.device("meta"):
            # A given weight skips nn.Embedding's random init: on meta it would still import torch._dynamo (its
            # normal_ decomposes through torch._refs), ~80 MiB of resident modules (sympy) for nothing.
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                             _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
            self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.embed_tokens: nn.Embedding | QuantizedEmbedding
            self.lm_head: DenseLinear | QuantizedLinear | None = (
                None if cfg.tie_word_embeddings else DenseLinear(cfg.hidden_size, cfg.vocab_size, bias=False))
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, self.device
        )
        self.requires_grad_(False)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        batch: ForwardBatch,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [T] (flattened over the batch's sequences) -> float32 logits [len(logits_indices) or T, vocab].

        The cache is extended by the batch's new tokens; call `cache.commit(batch)` afterwards.
        """
        x = self.embed_tokens(input_ids).to(self.dtype)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(batch.positions, batch.max_position)
        for layer in self.layers:
            x = layer(x, cos, sin, cache, batch)
        if logits_indices is not None:
            x = x[logits_indices]
        x = self.norm(x)
        if self.lm_head is not None:
            return self.lm_head(x).float()
        weight = self.embed_tokens.weight  # tied, dense
        return F.linear(x.to(weight.dtype), weight).float()

    def load_hf_state_dict(self, tensors: Mapping[str, torch.Tensor], progress: bool = False,
                           finish_layer: Callable[[nn.Module], None] | None = None) -> None:
        """Take tensors named as in Hugging Face checkpoints (model.layers.N.self_attn.q_proj.weight, ...);
        finish_layer(layer) runs on each decoder layer once its weights are in (torchao quantizes it there)."""
        cfg = self.config

        def take(name: str) -> torch.Tensor:
            if name not in tensors:
                raise CorruptWeightsError(
                    f"the checkpoint has no tensor {name!r}, which its config requires; the weights file is "
                    "incomplete or belongs to a different model"
                )
            return tensors[name]

        def put(param_owner: nn.Module, attr: str, value: torch.Tensor, expected: tuple[int, ...],
                dtype: torch.dtype | None = None) -> None:
            if tuple(value.shape) != expected:
                raise CorruptWeightsError(
                    f"tensor for {attr} has shape {tuple(value.shape)}, the config implies {expected}"
                )
            setattr(param_owner, attr, nn.Parameter(value.to(self.device, dtype or self.dtype), requires_grad=False))

        def project(owner: nn.Module, attr: str, names: list[str], bias_names: list[str] | None,
                    expected: tuple[int, int], head: bool = False) -> None:
            """owner.attr = the projection stacking the named weights' rows: dense, or kept as blocks."""
            parts = [take(n) for n in names]
            bias = torch.cat([take(n) for n in bias_names]) if bias_names else None
            if not any(isinstance(p, QuantizedTensor) for p in parts):
                put(getattr(owner, attr), "weight", torch.cat(parts), expected, self.weights_dtype)
                if bias is not None:
                    put(getattr(owner, attr), "bias", bias, (expected[0],), self.weights_dtype)
                return
            shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
            if shape != expected or any(p.shape[1] != expected[1] for p in parts):
                raise CorruptWeightsError(f"tensors for {attr} have shape {shape}, the config implies {expected}")
            parts = [p if isinstance(p, QuantizedTensor) else p.float() for p in parts]
            bias = None if bias is None else bias.float()
            setattr(owner, attr, QuantizedLinear(parts, bias, self.workspace,
                                                 float_activations=head))

        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        embedding = take("model.embed_tokens.weight")
        if isinstance(embedding, QuantizedTensor):
            if embedding.shape != (cfg.vocab_size, hidden):
                raise CorruptWeightsError(
                    f"tensor for embed_tokens has shape {embedding.shape}, the config implies {(cfg.vocab_size, hidden)}")
            self.embed_tokens = QuantizedEmbedding(embedding, self.workspace, self.dtype)
            if self.lm_head is None:  # tied: the output projection reads the same blocks
                self.lm_head = QuantizedLinear([embedding], None, self.workspace,
                                               float_activations=True)
        else:
            put(self.embed_tokens, "weight", embedding, (cfg.vocab_size, hidden),
                self.weights_dtype if self.lm_head is None else None)
        put(self.norm, "weight", take("model.norm.weight"), (hidden,))
        if self.lm_head is not None and not cfg.tie_word_embeddings:
            project(self, "lm_head", ["lm_head.weight"], None, (cfg.vocab_size, hidden), head=True)
        for i, layer in enumerate(tqdm(self.layers, desc="loading layers", unit="layer", disable=not progress)):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            put(layer.input_layernorm, "weight", take(p + "input_layernorm.weight"), (hidden,))
            put(layer.post_attention_layernorm, "weight", take(p + "post_attention_layernorm.weight"), (hidden,))
            fused = cfg.fused_projections  # Phi-3: one qkv_proj, one gate_up_proj
            project(attn, "qkv_proj", [p + "self_attn.qkv_proj.weight"] if fused else
                    [p + f"self_attn.{n}_proj.weight" for n in "qkv"],
                    [p + f"self_attn.{n}_proj.bias" for n in "qkv"] if cfg.qkv_bias else None,
                    (q_size + 2 * kv_size, hidden))
            project(attn, "o_proj", [p + "self_attn.o_proj.weight"], None, (hidden, q_size))
            if cfg.qk_norm:
                put(attn.q_norm, "weight", take(p + "self_attn.q_norm.weight"), (cfg.head_dim,))
                put(attn.k_norm, "weight", take(p + "self_attn.k_norm.weight"), (cfg.head_dim,))
            gate_up = ([p + "mlp.gate_up_proj.weight"] if fused else
                       [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
            project(mlp, "gate_up_proj", gate_up, None, (2 * inter, hidden))
            project(mlp, "down_proj", [p + "mlp.down_proj.weight"], None, (hidden, inter))
            if finish_layer is not None:
                finish_layer(layer)

    def num_parameters(self) -> int:
        """Weights of the model however stored (a block-format matrix counts rows x cols; a tied table once)."""
        counts = {id(p): p.numel() for p in self.parameters()}
        for module in self.modules():
            parts = module.parts if isinstance(module, QuantizedLinear) else \
                [module.table] if isinstance(module, QuantizedEmbedding) else []
            for part in parts:
                stored = part.blocks if isinstance(part, QuantizedTensor) else part
                counts[id(stored)] = part.shape[0] * part.shape[1]
        return sum(counts.values())

    def num_parameter_bytes(self) -> int:
        """Bytes the weights take as stored (block formats and torchao's tensors at their real size; a tied table
        counted once)."""
        tensors = {id(t): t for t in (*self.parameters(), *self.buffers())}
        return sum(tensor_bytes(t) for t in tensors.values())
