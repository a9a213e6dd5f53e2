"""FlashMemoryEngine: the public Python API — load a model once, then generate, stream or chat."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from flashmemory.config import EngineConfig
from flashmemory.engine.budget_controller import BudgetController
from flashmemory.engine.cache_factory import (build_budget_controller, build_kv_cache,
                                              check_budgets, device_plan_for,
                                              kv_fingerprint_source)
from flashmemory.engine.core import Delivery, EngineCore
from flashmemory.engine.forward import forward_chunks
from flashmemory.engine.observer import StepObserver
from flashmemory.engine.options import RequestOptions, is_batch, request_options
from flashmemory.engine.request import SequenceOutput, SequenceRequest
from flashmemory.engine.scheduling_policy import POLICIES, SchedulingPolicy
from flashmemory.engine.scoring import ScoreResult, score_tokens
from flashmemory.engine.stats import GenerationStats, peak_memory
from flashmemory.errors import (ConfigError, EngineBusyError, FlashMemoryError, MemoryBudgetError,
                                PromptTooLongError)
from flashmemory.engine.sizing import DevicePlan
from flashmemory.engine.speculative.budget_split import BudgetSplit, split_budgets
from flashmemory.engine.speculative.build import Target, build_speculator
from flashmemory.engine.speculative.speculator import Speculator
from flashmemory.guardrail.loader import build_guardrail
from flashmemory.guardrail.pool import GuardrailPool
from flashmemory.kvcache.interface import KVCache
from flashmemory.kvcache.kv_stats import KVStats
from flashmemory.kvcache.levels.compaction import CompactResult
from flashmemory.kvcache.manager.blocks import level_label
from flashmemory.kvcache.preload import PreloadResult
from flashmemory.model.loader import build_model, open_checkpoint, weights_bytes, weights_label
from flashmemory.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Messages = list[dict[str, str]]
MAX_LOGITS_BYTES = 2 * 2**30  # prompt_logits refuses to build more than this (score_tokens has no such limit)
Prompt = str | list[int]


class FlashMemoryEngine:
    """Owns a loaded model, its tokenizer and its KV cache; serves generate / stream / chat calls."""

    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model_path=model_path, **kwargs)
        if self.config.num_threads is not None:
            torch.set_num_threads(self.config.num_threads)
        self.device = self.config.resolve_device()
        self.dtype = self.config.resolve_dtype(self.device)
        started = time.perf_counter()
        checkpoint = open_checkpoint(self.config.model_path)
        self.model_path = checkpoint.path
        self.model_config = checkpoint.config
        model_limit = checkpoint.config.max_context_tokens
        if self.config.max_seq_len is not None and self.config.max_seq_len > model_limit:
            raise ConfigError(
                f"max_seq_len={self.config.max_seq_len} is greater than the model's maximum context length "
                f"({model_limit} tokens); lower max_seq_len or leave it unset"
            )
        self.max_seq_len = self.config.max_seq_len or model_limit
        # A draft model shares every budget with the target (engine/speculative/budget_split.py).
        self.draft_checkpoint = (open_checkpoint(self.config.draft_model_path)
                                 if self.config.speculation == "draft" else None)
        self.budget_split: BudgetSplit | None = self._split(self.config)
        # Before loading weights: a budget that cannot work fails fast.
        check_budgets(self.config)
        # The output classifier (CPU only, no device bytes); a bad guardrail_path fails here too.
        self.guardrail: GuardrailPool | None = build_guardrail(self.config)
        # Weights as stored (block formats at their size): estimated before loading, then measured.
        self.weights_bytes = weights_bytes(checkpoint, self.config.weights_dtype, self.dtype, self.device)
        self.device_plan: DevicePlan | None = device_plan_for(
            self._cache_config, self.model_config, self.max_seq_len, self.dtype, self.weights_bytes)
        self.model = build_model(checkpoint, self.device, self.dtype, self.config.weights_dtype,
                                 self.config.decode_activations)
        self.weights_bytes = self.model.num_parameter_bytes()
        self.weights_label = weights_label(self.config.weights_dtype, self.device,
                                           self.model.workspace.activations)
        if not self.config.rope_sharding:
            self.model.rotary.tabulate(self.max_seq_len)  # one table now instead of shards as positions come
        self.tokenizer = Tokenizer.from_checkpoint(
            checkpoint.path, checkpoint.config.eos_token_ids, self.config.parse_special_tokens_in_content)
        self.cache: KVCache = self._build_cache()
        self.speculator: Speculator | None = build_speculator(
            self.config if self.budget_split is None else self.budget_split.draft,
            Target(self.tokenizer, self.weights_bytes, self.max_seq_len, self.device, self.dtype,
                   self._kv_fingerprint_source()), self.draft_checkpoint)
        self.last_stats = GenerationStats()
        self.last_kv_stats: dict[str, int | float] = {}
        self.last_kv_snapshot: KVStats | None = None  # last_kv_stats, typed
        self.last_token_ids: list[int] = []  # prompt + generated tokens of the last finished generation
        self._core: EngineCore | None = None
        self.budget_controller: BudgetController | None = build_budget_controller(
            self.config, self.cache, self.device, self._refresh_capacity)
        self.load_seconds = time.perf_counter() - started
        logger.info(
            "loaded %s (%s, %d layers) on %s as %s in %.1f s",
            self.model_path.name, self.model_config.architecture, self.model_config.num_layers,
            self.device, str(self.dtype).removeprefix("torch."), self.load_seconds,
        )

    @property
    def _cache_config(self) -> EngineConfig:
        """The settings the target's KV cache is built from: the engine's, less a draft's share."""
        return self.config if self.budget_split is None else self.budget_split.target

    def _split(self, config: EngineConfig) -> BudgetSplit | None:
        if self.draft_checkpoint is None:
            return None
        return split_budgets(config, self.model_config, self.draft_checkpoint, self.dtype,
                             self.device, self.max_seq_len)

    def _build_cache(self) -> KVCache:
        config = self._cache_config
        try:
            self.device_plan = device_plan_for(config, self.model_config, self.max_seq_len,
                                               self.dtype, self.weights_bytes)
        except MemoryBudgetError as e:
            if self.budget_split is None or self.budget_split.draft_device_mb is None:
                raise
            raise MemoryBudgetError(
                f"the draft model takes {self.budget_split.draft_device_mb} MiB of "
                f"max_gpu_memory_mb={self.config.max_gpu_memory_mb}, leaving the target "
                f"{config.max_gpu_memory_mb} MiB: {e}") from e
        return build_kv_cache(config, self.model_config, self.device_plan, self.max_seq_len,
                              self.device, self.dtype, self._kv_fingerprint_source())

    def _kv_fingerprint_source(self) -> str:
        return kv_fingerprint_source(self.model_path, self.model_config, self.dtype,
                                     self.weights_label)

    # ---- the engine core ---------------------------------------------------------------------------------------

    @property
    def core(self) -> EngineCore:
        """The token loop every generation runs through (rebuilt when the KV cache is replaced)."""
        if self._core is None or self._core.cache is not self.cache:
            policy = POLICIES[self.config.scheduling_policy]
            self._core = EngineCore(self.model, self.cache, self.tokenizer, self.max_seq_len, self.device,
                                    self.config.prefill_chunk_tokens, policy=policy,
                                    speculator=self.speculator, **self._gate_args())
        return self._core

    def configure_core(self, max_num_batched_tokens: int | None = None, observer: StepObserver | None = None,
                       policy: SchedulingPolicy | None = None) -> EngineCore:
        """Replace the core with one of other settings (the server's); no sequence may be live."""
        if self._core is not None and self._core.num_live:
            raise ConfigError("the engine core has live sequences; finish or abort them before reconfiguring it")
        self._core = EngineCore(self.model, self.cache, self.tokenizer, self.max_seq_len, self.device,
                                max_num_batched_tokens or self.config.prefill_chunk_tokens, observer,
                                policy or POLICIES[self.config.scheduling_policy], self.speculator,
                                **self._gate_args())
        return self._core

    def _gate_args(self) -> dict[str, Any]:
        return {"guardrail": self.guardrail, "guardrail_chunk_tokens": self.config.guardrail_chunk_tokens,
                "guardrail_on_error": self.config.guardrail_on_error}

    def step_core(self, core: EngineCore) -> list[Delivery]:
        """One step of `core`; with a budget controller, timed for it (it may then resize L0 between steps)."""
        if self.budget_controller is None:
            return core.step()
        with self.budget_controller.busy():
            out = core.step()
        self.budget_controller.tick()
        return out

    def _refresh_capacity(self) -> None:
        """The L0 budget moved: the scheduler checks its steps against the new capacity from now on."""
        if self._core is not None:
            self._core.scheduler.budget = self.cache.kv_capacity()

    # ---- public API -------------------------------------------------------------------------------------------

    def generate(self, prompt: Prompt | list[Prompt], **options: Any) -> str | list[str]:
        """Complete `prompt` (text or token ids); returns the generated text. A list of prompts (texts, or lists
        of token ids) runs as one batch and returns one text per prompt, in order.

        Options: the SamplingParams fields; `pinned_spans=[(start, end), ...]`, token ranges of the prompt kept in
        device memory whatever the window (e.g. a system prompt); `progress=callable(done, total)`, told after each
        prefill step how many prompt tokens are computed (the CLI draws a bar with it).
        """
        if is_batch(prompt):
            started = time.perf_counter()
            opts = request_options(options)
            prompts = [self._prompt_ids(p) for p in prompt]
            for ids in prompts:
                self.check_prompt(ids, opts.params.max_new_tokens)
            requests = [_request(i, ids, opts, started) for i, ids in enumerate(prompts)]
            results = self._run_batch(requests)
            return ["".join(out.text for out in outs) for outs in results]
        return "".join(self.stream(prompt, **options))

    def stream(self, prompt: Prompt, **options: Any) -> Iterator[str]:
        """Complete `prompt`, yielding text pieces as they are decoded."""
        started = time.perf_counter()
        opts = request_options(options)
        return self._stream_ids(self._prompt_ids(prompt), opts, started)

    def chat(self, messages: Messages, **options: Any) -> str:
        """Answer a conversation ([{"role": ..., "content": ...}, ...]) through the model's chat template.

        `pin_system_prompt=True` keeps the system message's tokens in device memory.
        """
        return "".join(self.stream_chat(messages, **options))

    def stream_chat(self, messages: Messages, pin_system_prompt: bool = False, **options: Any) -> Iterator[str]:
        started = time.perf_counter()
        opts = request_options(options)
        prompt_ids = self.tokenizer.apply_chat_template(messages)
        if pin_system_prompt and messages and messages[0].get("role") == "system":
            system_ids = self.tokenizer.apply_chat_template(messages[:1], add_generation_prompt=False)
            opts.pinned.append((0, len(system_ids)))
        return self._stream_ids(prompt_ids, opts, started)

    def generate_token_ids(self, prompt: Prompt | list[Prompt], **options: Any) -> list[int] | list[list[int]]:
        """Complete `prompt`; returns the generated token ids (end-of-sequence token excluded). A list of prompts
        runs as one batch and returns one list of ids per prompt."""
        started = time.perf_counter()
        opts = request_options(options)
        batch = is_batch(prompt)
        prompts = [self._prompt_ids(p) for p in prompt] if batch else [self._prompt_ids(prompt)]
        for ids in prompts:
            self.check_prompt(ids, opts.params.max_new_tokens)
        requests = [_request(i, ids, opts, started) for i, ids in enumerate(prompts)]
        if not batch:
            return [out.token_id for out in self._outputs(requests[0]) if out.token_id is not None]
        return [[out.token_id for out in outs if out.token_id is not None] for outs in self._run_batch(requests)]

    def score_tokens(self, token_ids: list[int], num_teacher_forced: int = 0,
                     kv_snapshot: Path | None = None) -> ScoreResult:
        """Log-probabilities the model gives each next token of `token_ids` (for perplexity and fidelity), the
        prompt optionally restored from / saved to a KV snapshot file; see engine/scoring.py."""
        return score_tokens(self, token_ids, num_teacher_forced, kv_snapshot)

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """float32 logits [len(token_ids), vocab] of one forward over the tokens (for evaluation and tests)."""
        self.check_prompt(token_ids, max_new_tokens=0)
        size = len(token_ids) * self.model_config.vocab_size * 4
        if size > MAX_LOGITS_BYTES:
            raise ConfigError(f"prompt_logits of {len(token_ids)} tokens would hold {size / 2**30:.1f} GiB of logits "
                              f"(vocabulary {self.model_config.vocab_size}); use score_tokens, which keeps the "
                              "log-probabilities of the actual next tokens, for long texts")
        seq_id = self.core.next_seq_id()
        self.cache.add_sequence(seq_id)
        try:
            return self.forward_tokens(seq_id, token_ids, all_logits=True)
        finally:
            self.cache.free_sequence(seq_id)

    def save_session(self, name: str, token_ids: list[int] | None = None) -> int:
        """Keep a conversation's KV under `name` (never evicted until deleted; with persist_cache, across restarts):
        by default the last finished generation (prompt and answer). Returns the tokens whose KV is kept."""
        tokens = self.last_token_ids if token_ids is None else list(token_ids)
        if not tokens:
            raise ConfigError("nothing to save: generate something first, or pass token_ids")
        return self.cache.save_session(name, tokens)

    def load_session(self, name: str) -> list[int]:
        """The token ids of a saved session: a prompt that starts with them reuses their KV."""
        tokens = self.cache.load_session(name)
        if tokens is None:
            raise ConfigError(f"no session named {name!r}; saved: {', '.join(self.sessions()) or 'none'}")
        return tokens

    def delete_session(self, name: str) -> None:
        self.cache.delete_session(name)

    def preload(self, prompt: Prompt, timeout_s: float | None = None,
                interrupted: Callable[[], bool] = lambda: False) -> PreloadResult:
        """Bring the cached KV of `prompt`'s longest cached prefix (text or token ids) up from disk
        and host memory to where its next request reads it (kvcache/preload.py), before it comes:
        its time to first token then skips those reads. Stops after `timeout_s` seconds, or before
        the next block once `interrupted()` (the server: a request arrived)."""
        deadline = None if timeout_s is None else time.perf_counter() + timeout_s

        def should_stop() -> str | None:
            if interrupted():
                return "request"
            return "timeout" if deadline is not None and time.perf_counter() >= deadline else None

        return self.cache.preload_prefix(self._prompt_ids(prompt), should_stop)

    def compact_kv(self, should_stop: Callable[[], bool] = lambda: False
                   ) -> dict[str, CompactResult]:
        """Give back the disk blocks of freed records on every file level (kvcache/levels/
        compaction.py), by level label; idle time only (the server runs it when idle)."""
        levels = getattr(self.cache, "levels", {})
        return {level_label(lv): pool.compact(should_stop) for lv, pool in levels.items()
                if hasattr(pool, "compact")}

    def preload_session(self, name: str, timeout_s: float | None = None,
                        interrupted: Callable[[], bool] = lambda: False) -> PreloadResult:
        """preload() of a saved session's tokens (say, after a restart, while its user types)."""
        return self.preload(self.load_session(name), timeout_s, interrupted)

    def sessions(self) -> list[str]:
        """Names of the saved sessions, sorted (none where the KV cache keeps no sessions)."""
        return sorted(self.cache.session_names())

    def reconfigure_kv(self, **knobs: Any) -> None:
        """Replace the KV cache with one built from the default KV settings plus `knobs` (weights stay loaded).

        Knobs are EngineConfig's KV fields (kv_cache, kv_precision, active_window, ...); settings not given
        return to their defaults, not to earlier values. Every sequence is dropped.
        """
        kv_names = EngineConfig.kv_field_names()
        unknown = sorted(set(knobs) - set(kv_names))
        if unknown:
            raise ConfigError(f"unknown KV setting(s) {', '.join(unknown)}; valid: {', '.join(kv_names)}")
        defaults = EngineConfig()
        new_config = self.config.replace(**{**{n: getattr(defaults, n) for n in kv_names}, **knobs})
        check_budgets(new_config)
        self._require_idle("reconfigure_kv()")
        self.cache.close()  # the target's levels only: a draft model keeps its own
        self.config = new_config
        self.budget_split = self._split(new_config)  # the draft's cache keeps its first share
        self.cache = self._build_cache()
        self.budget_controller = build_budget_controller(self.config, self.cache, self.device, self._refresh_capacity)

    def clear_cache(self) -> None:
        """Free all KV on every level: every sequence's blocks and the prefix cache's (saved
        sessions stay until delete_session). EngineBusyError while a sequence is generating."""
        self._require_idle("clear_cache()")
        self.cache.clear()

    def _require_idle(self, operation: str) -> None:
        """Refuse an operation that would pull the KV out from under running sequences (a stream
        mid-way would fail at its next token, and its blocks would be freed under it)."""
        seq_ids = self._core.live_seq_ids() if self._core is not None else []
        if seq_ids:
            raise EngineBusyError(
                f"{operation} was called while {len(seq_ids)} sequence(s) are generating "
                f"(sequence id {', '.join(map(str, seq_ids))}); finish them first: run each "
                "stream() / stream_chat() iterator to its end or call its close(), which frees "
                "its blocks, then call it again")

    def stats(self) -> dict[str, int | float]:
        """KV bytes and blocks per level, selected fractions, bytes moved between levels, load failures."""
        out = dict(self.cache.stats())
        out["weights_bytes"] = self.weights_bytes
        if self.speculator is not None:
            out.update(self.speculator.stats.as_dict())
        if self.budget_controller is not None:
            out.update(self.budget_controller.stats())
        if self.guardrail is not None:
            out.update(self.guardrail.stats.as_dict())
        return out

    def health(self) -> dict[str, Any]:
        """{"status": "ok"}, or "degraded" with the reasons: a KV level not as it should be (its
        file deleted and not re-creatable). The reasons name no file (/health is public)."""
        levels = getattr(self.cache, "levels", {})
        reasons = [f"L{int(level)}: {reason}" for level, pool in levels.items()
                   if (reason := pool.health()) is not None]
        return {"status": "degraded", "reasons": reasons} if reasons else {"status": "ok"}

    def close(self) -> None:
        """Release the KV levels (the cold-zone file included), the draft model's too."""
        self.cache.close()
        if self.speculator is not None:
            self.speculator.close()
        if self.guardrail is not None:
            self.guardrail.close()

    def check_prompt(self, prompt_ids: list[int], max_new_tokens: int = 0) -> None:
        """Raise what generate() would for this prompt: ConfigError for no tokens or an id
        outside the vocabulary, PromptTooLongError when the prompt plus max_new_tokens does not
        fit max_seq_len (with max_new_tokens=0, as when scoring, it may fill the context)."""
        _check_token_ids(prompt_ids, self.model_config.vocab_size)
        n = len(prompt_ids)
        # Generation needs room for at least one new token; scoring (max_new_tokens=0) may fill the context.
        if n > self.max_seq_len or (n == self.max_seq_len and max_new_tokens > 0):
            raise PromptTooLongError(
                f"This model's maximum context length is {self.max_seq_len} tokens. However, you requested "
                f"{n + max_new_tokens} tokens ({n} in the prompt, {max_new_tokens} in the completion). "
                "Please reduce the length of the prompt.",
                max_model_len=self.max_seq_len,
                num_prompt_tokens=n,
            )

    def forward_tokens(self, seq_id: int, token_ids: list[int],
                       all_logits: bool = False) -> torch.Tensor:
        """Extend sequence `seq_id` of `engine.cache` by `token_ids` (KV stored and committed),
        through the model in chunks of prefill_chunk_tokens, no sampling; returns the logits
        [1, vocab] of the last token, or [len(token_ids), vocab] with `all_logits`. The caller
        adds the sequence first (`engine.cache.add_sequence(seq_id)`) and frees it after
        (`engine.cache.free_sequence(seq_id)`)."""
        if not self.cache.has_sequence(seq_id):
            raise ConfigError(f"sequence {seq_id} is not in the KV cache: call "
                              f"engine.cache.add_sequence({seq_id}) before forward_tokens, and "
                              f"engine.cache.free_sequence({seq_id}) after")
        _check_token_ids(token_ids, self.model_config.vocab_size)
        total = self.cache.num_tokens(seq_id) + len(token_ids)
        if total > self.max_seq_len:
            raise PromptTooLongError(
                f"sequence {seq_id} would hold {total} tokens; this model's maximum context "
                f"length is {self.max_seq_len} tokens: forward fewer tokens or start a new "
                "sequence",
                max_model_len=self.max_seq_len, num_prompt_tokens=total)
        return forward_chunks(self.model, self.cache, self.device, seq_id, token_ids,
                              self.config.prefill_chunk_tokens, all_logits)

    # ---- generation -------------------------------------------------------------------------------------------

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def _stream_ids(self, prompt_ids: list[int], opts: RequestOptions, started: float) -> Iterator[str]:
        self.check_prompt(prompt_ids, opts.params.max_new_tokens)
        # Validation above raises at call time; the generation runs as the caller iterates.
        request = _request(0, prompt_ids, opts, started)
        return (out.text for out in self._outputs(request) if out.text)

    def _outputs(self, request: SequenceRequest) -> Iterator[SequenceOutput]:
        """Run one sequence through the core, yielding its outputs as the steps produce them; the sequence is
        aborted (its blocks freed) if the caller stops iterating early."""
        request.capture_kv_stats = True
        stats = GenerationStats(num_prompt_tokens=len(request.prompt_ids))
        self.last_stats = stats
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        core = self.core
        pending: list[SequenceOutput] = []
        generated: list[int] = []
        seq_id = core.add(request, pending.append)
        done = False
        try:
            while not done:
                while not pending:
                    for sink, step_out in self.step_core(core):
                        sink(step_out)
                out = pending.pop(0)
                done = out.finish_reason is not None or out.error is not None
                if out.token_id is not None:
                    generated.append(out.token_id)
                if out.finish_reason is not None:
                    self.last_token_ids = list(request.prompt_ids) + generated
                self._account(stats, request, out)
                if out.exception is not None:
                    raise out.exception
                if out.error is not None:
                    raise FlashMemoryError(out.error)
                yield out
        finally:
            if not done:
                core.abort(seq_id)
            stats.peak_memory_bytes, stats.memory_kind = peak_memory(self.device)

    def _run_batch(self, requests: list[SequenceRequest]) -> list[list[SequenceOutput]]:
        """Run several sequences as one batch to the end; each one's outputs, in request order."""
        results: list[list[SequenceOutput]] = [[] for _ in requests]
        stats = GenerationStats(num_prompt_tokens=sum(len(r.prompt_ids) for r in requests))
        self.last_stats = stats
        core = self.core
        seq_ids = [core.add(r, results[r.index].append) for r in requests]
        finished = 0
        try:
            while finished < len(requests):
                for sink, out in self.step_core(core):
                    sink(out)
                    finished += out.finish_reason is not None or out.error is not None
                    self._account(stats, requests[out.index], out)
                    if out.exception is not None:
                        raise out.exception
                    if out.error is not None:
                        raise FlashMemoryError(out.error)
        finally:
            for seq_id in seq_ids:
                core.abort(seq_id)  # a no-op for the finished ones
            stats.peak_memory_bytes, stats.memory_kind = peak_memory(self.device)
        return results

    def _account(self, stats: GenerationStats, request: SequenceRequest, out: SequenceOutput) -> None:
        """Fold one output into the call's GenerationStats (and the KV snapshot taken as it ended)."""
        stats.num_generated_tokens += out.num_new_tokens
        if out.num_new_tokens and not stats.first_token_at_s:
            stats.time_to_first_token_s = out.produced_s - request.arrival_s
            if out.first_forward_s is not None:
                stats.prefill_seconds = out.produced_s - out.first_forward_s
            stats.first_token_at_s = out.produced_s
        if out.num_new_tokens:
            stats.decode_seconds = out.produced_s - stats.first_token_at_s
        if out.finish_reason is not None:
            stats.finish_reason = out.finish_reason
            stats.stop_reason = out.stop_reason or ""
            if out.kv_stats:
                self.last_kv_stats = out.kv_stats
                self.last_kv_snapshot = out.kv_snapshot


def _check_token_ids(token_ids: list[int], vocab_size: int) -> None:
    if not token_ids:
        raise ConfigError("the prompt is empty: give at least one token of text")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ConfigError(f"token id(s) {bad[:5]} are outside the vocabulary [0, {vocab_size})")


def _request(index: int, prompt_ids: list[int], opts: RequestOptions, started: float) -> SequenceRequest:
    return SequenceRequest(index, prompt_ids, opts.params, started, tuple(opts.pinned), progress=opts.progress)
