"""guardrail_path -> a classifier: the toxic-comment-classifier package by name, a folder of its
format, or a Hugging Face sequence-classification folder."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from flashmemory.errors import ConfigError
from flashmemory.guardrail.classifier import Guardrail
from flashmemory.guardrail.hf_classifier import HFSequenceClassifier, is_hf_classifier
from flashmemory.guardrail.keras_bilstm import TOKENIZER_FILE, WEIGHTS_FILE, BiLSTMClassifier
from flashmemory.guardrail.pool import GuardrailPool
from flashmemory.guardrail_settings import TOXIC_COMMENT_CLASSIFIER, GuardrailSettings

_PACKAGE_MODULE = "toxic_classifier"  # the import name of toxic-comment-classifier
logger = logging.getLogger(__name__)
INSTALL = "pip install --no-deps toxic-comment-classifier==0.3.0 h5py (scripts/setup.sh does)"


def packaged_classifier_folder() -> Path:
    """Where the installed toxic-comment-classifier keeps its model files (found without
    importing the package, which imports TensorFlow)."""
    spec = importlib.util.find_spec(_PACKAGE_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"guardrail_path='{TOXIC_COMMENT_CLASSIFIER}' needs that package: {INSTALL}")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def load_guardrail(path: str, precision: str) -> Guardrail:
    if path == TOXIC_COMMENT_CLASSIFIER:
        return BiLSTMClassifier(packaged_classifier_folder(), precision)
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError(
            f"guardrail_path={path!r} is neither '{TOXIC_COMMENT_CLASSIFIER}' nor a folder; give "
            f"'{TOXIC_COMMENT_CLASSIFIER}' ({INSTALL}), a folder holding {WEIGHTS_FILE} and "
            f"{TOKENIZER_FILE}, or a Hugging Face sequence-classification folder")
    if (folder / WEIGHTS_FILE).is_file():
        return BiLSTMClassifier(folder, precision)
    if is_hf_classifier(folder):
        return HFSequenceClassifier(folder, precision)
    raise ConfigError(f"{folder} holds neither {WEIGHTS_FILE} (a toxic-comment-classifier "
                      "model) nor config.json (a Hugging Face classifier)")


def build_guardrail(settings: GuardrailSettings) -> GuardrailPool | None:
    """The engine's guardrail pool from its settings; None without guardrail_path."""
    if settings.guardrail_path is None:
        unused = settings.unused_guardrail_settings()
        if unused:
            logger.warning("%s set without guardrail_path: no guardrail runs (give "
                           "guardrail_path='%s' or a classifier folder)", ", ".join(unused),
                           TOXIC_COMMENT_CLASSIFIER)
        return None
    classifier = load_guardrail(settings.guardrail_path, settings.guardrail_precision)
    return GuardrailPool(classifier, settings.guardrail_threshold, settings.guardrail_timeout_ms,
                         settings.guardrail_threads)
