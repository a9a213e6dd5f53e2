"""A Hugging Face sequence-classification folder as a guardrail (config.json, the tokenizer's
files, the weights), loaded with transformers on the CPU; int8 rounds its linear layers' weights by
torch's dynamic quantization (int8 weights, activations quantized per call).

Scores: sigmoid per label for a multi-label model (config problem_type
multi_label_classification, as Jigsaw-style toxicity models are), else softmax, where the classes
named as harmless (PASS_LABELS: neutral, non-toxic, ok, ...) never flag."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from flashmemory.errors import ConfigError

PASS_LABELS = frozenset({"neutral", "non-toxic", "non_toxic", "nontoxic", "not_toxic", "not toxic",
                         "ok", "safe", "clean", "normal", "benign"})
MAX_TOKENS = 512  # longer texts keep their last 512 tokens


def is_hf_classifier(folder: Path) -> bool:
    return (folder / "config.json").is_file()


class HFSequenceClassifier:
    """transformers' AutoModelForSequenceClassification on the CPU, one text per call."""

    def __init__(self, folder: Path, precision: str = "int8") -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        try:
            model = AutoModelForSequenceClassification.from_pretrained(
                folder, torch_dtype=torch.float32, local_files_only=True)
            self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"{folder} is not a Hugging Face sequence-classification folder "
                              f"transformers can load: {e}") from e
        model.eval()
        self.tokenizer.truncation_side = "left"
        if precision == "int8":
            model = _int8_linear(model)
        self.model = model
        id2label = model.config.id2label
        self.labels = tuple(str(id2label[i]) for i in range(model.config.num_labels))
        self.multi_label = model.config.problem_type == "multi_label_classification"
        self.name = f"{folder.name} (transformers, {precision})"
        self.precision = precision

    def scores(self, text: str) -> dict[str, float]:
        enc = self.tokenizer(text, return_tensors="pt", truncation=True, max_length=MAX_TOKENS)
        with torch.inference_mode():
            logits = self.model(**enc).logits[0].float()
        p = torch.sigmoid(logits) if self.multi_label else torch.softmax(logits, dim=-1)
        out = dict(zip(self.labels, p.tolist()))
        if not self.multi_label:
            out = {k: v for k, v in out.items() if k.lower() not in PASS_LABELS}
        return out

    def weights_bytes(self) -> int:
        n = 0
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            n += t.numel() * t.element_size()
        for m in self.model.modules():  # dynamically quantized linears keep packed weights
            if hasattr(m, "_packed_params") and callable(getattr(m, "weight", None)):
                w, b = m.weight(), m.bias()
                n += w.numel() * w.element_size() + (0 if b is None else b.numel() * 4)
        return n


def _int8_linear(model: torch.nn.Module) -> torch.nn.Module:
    try:
        from torch.ao.quantization import quantize_dynamic
    except ImportError as e:
        raise ConfigError("this torch has no dynamic quantization for an int8 guardrail; set "
                          "guardrail_precision='float32'") from e
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice
        return quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
