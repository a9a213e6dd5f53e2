"""The engine's Speculator from its settings: prompt lookup, or a draft model loaded beside the
target (its own weights and KV cache, built from the same KV settings) after the checks that it
can draft for this target: not larger, a context as long; another tokenizer is bridged."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from flashmemory.config import EngineConfig
from flashmemory.engine.cache_factory import build_kv_cache, device_plan_for, kv_fingerprint_source
from flashmemory.engine.speculative.draft_model import DraftBridges, DraftModelProposer
from flashmemory.engine.speculative.ngram import NgramProposer
from flashmemory.engine.speculative.speculator import Speculator
from flashmemory.errors import ConfigError
from flashmemory.model.loader import Checkpoint, build_model, weights_bytes, weights_label
from flashmemory.model.token_bridge import bridges_between
from flashmemory.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
DRAFT_FOLDER = "draft-model"  # a persistent cache's draft keeps its own cold zone in here


@dataclass(frozen=True)
class Target:
    """What the draft is checked against and sized beside: the loaded target model."""

    tokenizer: Tokenizer
    weights_bytes: int
    max_seq_len: int
    device: torch.device
    dtype: torch.dtype
    fingerprint: str  # the target's KV fingerprint source; the draft's names its own model


def build_speculator(config: EngineConfig, target: Target,
                     draft: Checkpoint | None = None) -> Speculator | None:
    """None when speculative decoding is off; `config`: the draft's share of the budgets
    (budget_split.py), `draft`: its checkpoint, opened."""
    method = config.speculation
    if method == "off":
        return None
    if method == "ngram":
        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    else:
        assert draft is not None, "a draft model's checkpoint is opened with the target's"
        proposer = _draft_proposer(config, target, draft)
    return Speculator(proposer, config.num_speculative_tokens, config.speculative_adaptive,
                      config.speculative_cost_aware)


def _draft_proposer(config: EngineConfig, target: Target,
                    checkpoint: Checkpoint) -> DraftModelProposer:
    draft_bytes = weights_bytes(checkpoint, config.weights_dtype, target.dtype, target.device)
    if draft_bytes > target.weights_bytes:
        raise ConfigError(
            f"the draft model {checkpoint.path.name} ({draft_bytes / 2**20:.0f} MiB of weights) is "
            f"larger than the target ({target.weights_bytes / 2**20:.0f} MiB): a draft saves time "
            "only when it is much smaller; swap them, or pick a smaller draft")
    tokenizer = Tokenizer.from_checkpoint(checkpoint.path, checkpoint.config.eos_token_ids)
    bridges = _bridges(checkpoint, tokenizer, target.tokenizer)
    context = checkpoint.config.max_context_tokens
    if context < target.max_seq_len:
        raise ConfigError(
            f"the draft model {checkpoint.path.name} reads at most {context} tokens, fewer than "
            f"the target's {target.max_seq_len}: lower max_seq_len to {context}, or pick a draft "
            "with the target's context")
    model = build_model(checkpoint, target.device, target.dtype, config.weights_dtype,
                        config.decode_activations)
    label = weights_label(config.weights_dtype, target.device, model.workspace.activations)
    fingerprint = (kv_fingerprint_source(checkpoint.path, checkpoint.config, target.dtype, label)
                   + f":draft-of={target.fingerprint}")
    if config.persist_cache and config.cold_zone_dir is not None:  # the target locks its own
        config = config.replace(cold_zone_dir=str(Path(config.cold_zone_dir) / DRAFT_FOLDER))
    # The shared level holds the target's blocks: the draft reads its prompts through its own
    # levels (it never looks the shared level up, so it does not publish to it either).
    config = config.replace(remote_kv_url=None)
    plan = device_plan_for(config, checkpoint.config, target.max_seq_len, target.dtype,
                           model.num_parameter_bytes())
    cache = build_kv_cache(config, checkpoint.config, plan, target.max_seq_len, target.device,
                           target.dtype, fingerprint)
    logger.info("draft model %s loaded (%d layers, %.0f MiB of weights); up to %d tokens drafted "
                "a step", checkpoint.path.name, checkpoint.config.num_layers,
                model.num_parameter_bytes() / 2**20, config.num_speculative_tokens)
    return DraftModelProposer(model, cache, target.device, config.prefill_chunk_tokens,
                              target.max_seq_len, bridges)


def _bridges(checkpoint: Checkpoint, draft: Tokenizer, target: Tokenizer) -> DraftBridges | None:
    """The token bridges between a draft of another vocabulary and the target (None: the same
    vocabulary; a ConfigError naming the fix where the draft's tokens cannot be read as bytes)."""
    pair = bridges_between(target, draft)
    if pair is None:
        return None
    bridges = DraftBridges(to_draft=pair[0], to_target=pair[1])
    logger.info("the draft model %s has another tokenizer (%d tokens against %d): drafting "
                "through a token bridge; %.0f %% of its tokens are one target token",
                checkpoint.path.name, draft.vocab_size, target.vocab_size,
                100 * bridges.to_target.mapped_share)
    return bridges
