"""GuardrailSettings: the output classifier the engine runs on what it generates (seed 000 §4.3),
declared once with each field's Setting. EngineConfig includes them. Stdlib only."""

from __future__ import annotations

from dataclasses import dataclass

from flashmemory.settings import default_of, setting

# What guardrail_path names besides a folder: the classifier shipped by the PyPI package
# toxic-comment-classifier==0.3.0 (installed by scripts/setup.sh; read without TensorFlow).
TOXIC_COMMENT_CLASSIFIER = "toxic-comment-classifier"
GUARDRAIL_PRECISIONS = ("int8", "float32")
ON_ERROR = ("pass", "block")


@dataclass
class GuardrailSettings:
    """An output classifier on a CPU thread pool beside the engine, checked with a timeout."""

    guardrail_path: str | None = setting(
        None, f"output classifier checked on generated text: '{TOXIC_COMMENT_CLASSIFIER}' (the "
        "Jigsaw BiLSTM of that PyPI package), a folder holding model.weights.h5 and "
        "tokenizer.pickle of that format, or a Hugging Face sequence-classification folder; a "
        "flagged output ends with finish_reason content_filter; None = no guardrail")
    guardrail_precision: str = setting(
        "int8", "the classifier's weights in memory: int8 (per-row scales; the seed's INT8 "
        "offload) or float32 (as stored)", choices=GUARDRAIL_PRECISIONS)
    guardrail_timeout_ms: float = setting(
        50.0, "a check not answered within this long is skipped (the text is released), logged "
        "and counted, never retried", unit="ms", gt=0)
    guardrail_threshold: float = setting(
        0.5, "a label scoring at least this flags the text", unit="fraction", gt=0, le=1)
    guardrail_chunk_tokens: int = setting(
        16, "generated tokens held back and checked together (with the previous chunk's text "
        "for context); the rest of an output is checked when it ends", unit="tokens", ge=1)
    guardrail_on_error: str = setting(
        "pass", "when the classifier raises: pass (release the text, count the error) or block "
        "(end the output with content_filter)", choices=ON_ERROR)
    guardrail_threads: int = setting(
        1, "CPU threads that run checks (each runs torch with one intra-op thread)", ge=1)

    def unused_guardrail_settings(self) -> list[str]:
        """The guardrail settings given other values than their defaults while guardrail_path
        is None (they do nothing then: the engine warns)."""
        if self.guardrail_path is not None:
            return []
        return [name for name in GUARDRAIL_FIELDS if name != "guardrail_path"
                and getattr(self, name) != default_of(GuardrailSettings, name)]


GUARDRAIL_FIELDS = tuple(GuardrailSettings.__dataclass_fields__)
