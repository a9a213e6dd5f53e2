"""guardrail_path as a Hugging Face sequence-classification folder: a tiny random BERT the test
writes, loaded with transformers, int8 by dynamic quantization; the harmless class never flags."""

from __future__ import annotations

import pytest
import torch

from flashmemory.guardrail.hf_classifier import HFSequenceClassifier
from flashmemory.guardrail.loader import load_guardrail

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "you", "are", "kind", "bad", "a", "text"]


def write_classifier(folder, problem_type=None, labels=("neutral", "toxic")):
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    folder.mkdir()
    (folder / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(folder)
    config = BertConfig(vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                        num_labels=len(labels), id2label=dict(enumerate(labels)),
                        label2id={k: i for i, k in enumerate(labels)}, problem_type=problem_type)
    torch.manual_seed(0)
    BertForSequenceClassification(config).eval().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("precision", ["int8", "float32"])
def test_a_softmax_classifier_scores_its_harmful_classes_only(tmp_path, precision):
    c = load_guardrail(str(write_classifier(tmp_path / "clf")), precision)
    assert isinstance(c, HFSequenceClassifier) and c.labels == ("neutral", "toxic")
    scores = c.scores("you are kind")
    assert list(scores) == ["toxic"] and 0.0 <= scores["toxic"] <= 1.0
    assert c.weights_bytes() > 0


def test_int8_rounds_the_linear_layers_and_keeps_the_scores_close(tmp_path):
    folder = write_classifier(tmp_path / "clf", "multi_label_classification", ("toxic", "insult"))
    q, f = load_guardrail(str(folder), "int8"), load_guardrail(str(folder), "float32")
    assert "DynamicQuantizedLinear" in repr(q.model)
    assert "DynamicQuantizedLinear" not in repr(f.model)
    a, b = q.scores("you are a bad text"), f.scores("you are a bad text")
    assert list(a) == ["toxic", "insult"]  # multi-label: every label, sigmoid each
    assert max(abs(a[k] - b[k]) for k in a) < 0.05
