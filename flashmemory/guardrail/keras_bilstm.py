"""The Jigsaw toxicity BiLSTM of the PyPI package toxic-comment-classifier (0.3.0), read without
TensorFlow: its Keras tokenizer from the pickle through an unpickler that builds nothing but the
tokenizer's plain data, its Keras 3 weights from the .h5 file with h5py, the forward pass in torch.

The model, as the package builds it: the last 100 words' ids (unknown words dropped, padded in
front with id 0), an embedding 20,000 x 50, a bidirectional LSTM of 50 units per direction over
every position (padding included: the package masks nothing), the maximum over time, a dense
layer of 50 with ReLU, six sigmoids (toxic, severe_toxic, obscene, threat, insult, identity_hate).
"""

from __future__ import annotations

import collections
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flashmemory.errors import ConfigError
from flashmemory.guardrail.int8 import Int8Rows

LABELS = ("toxic", "severe_toxic", "obscene", "threat", "insult", "identity_hate")
MAX_WORDS = 100  # the package's MAXLEN: the classifier reads the last 100 words
WEIGHTS_FILE, TOKENIZER_FILE = "model.weights.h5", "tokenizer.pickle"
# The Keras tokenizer's class under the names Keras versions pickled it as.
_TOKENIZER_CLASSES = {("keras.src.legacy.preprocessing.text", "Tokenizer"),
                      ("keras.preprocessing.text", "Tokenizer"),
                      ("keras_preprocessing.text", "Tokenizer")}
_PLAIN = {("collections", "OrderedDict"): collections.OrderedDict,
          ("collections", "defaultdict"): collections.defaultdict,
          ("builtins", "int"): int, ("builtins", "list"): list, ("builtins", "dict"): dict}


class _TokenizerState:
    """Stands in for Keras' Tokenizer while unpickling: it only keeps the attributes."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


class _TokenizerUnpickler(pickle.Unpickler):
    """Builds the tokenizer's state and plain containers; any other class is refused (a pickle
    can name any callable, and loading it would run it)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _TOKENIZER_CLASSES:
            return _TokenizerState
        if (module, name) in _PLAIN:
            return _PLAIN[(module, name)]
        raise pickle.UnpicklingError(
            f"{module}.{name} is not part of a Keras tokenizer; this pickle is not loaded")


@dataclass(frozen=True)
class KerasWordTokenizer:
    """Keras' Tokenizer.texts_to_sequences and pad_sequences, as the classifier was trained."""

    word_index: dict[str, int]
    num_words: int | None
    filters: str
    lower: bool
    split: str
    oov_index: int | None

    @classmethod
    def read(cls, path: Path) -> KerasWordTokenizer:
        try:
            with open(path, "rb") as f:
                state = _TokenizerUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
            raise ConfigError(f"{path} is not a Keras tokenizer pickle: {e}") from e
        if not isinstance(state, _TokenizerState) or not isinstance(
                getattr(state, "word_index", None), dict):
            raise ConfigError(f"{path} holds no Keras tokenizer (no word_index)")
        if getattr(state, "char_level", False):
            raise ConfigError(f"{path} is a character-level tokenizer; only word-level is read")
        oov = getattr(state, "oov_token", None)
        return cls(state.word_index, getattr(state, "num_words", None),
                   getattr(state, "filters", ""), getattr(state, "lower", True),
                   getattr(state, "split", " "), None if oov is None else state.word_index.get(oov))

    def ids(self, text: str, length: int) -> list[int]:
        """The last `length` known words' ids, padded in front with 0 to `length`."""
        if self.lower:
            text = text.lower()
        text = text.translate(str.maketrans({c: self.split for c in self.filters}))
        out = []
        for word in text.split(self.split):
            i = self.word_index.get(word) if word else None
            if i is not None and (self.num_words is None or i < self.num_words):
                out.append(i)
            elif word and self.oov_index is not None:
                out.append(self.oov_index)
        out = out[-length:]
        return [0] * (length - len(out)) + out


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    try:
        import h5py
    except ImportError as e:
        raise ConfigError("reading a Keras .h5 guardrail needs h5py: pip install h5py") from e
    out: dict[str, torch.Tensor] = {}
    with h5py.File(path, "r") as f:
        def keep(name: str, obj: Any) -> None:
            if isinstance(obj, h5py.Dataset) and name.startswith("layers/"):
                out[name] = torch.from_numpy(obj[()]).to(torch.float32)
        f.visititems(keep)
    return out


class BiLSTMClassifier:
    """The package's classifier in torch; with precision int8 every matrix is rounded to 8 bits
    per row, the embedding (95 % of the bytes) stays int8 in memory and is dequantized per looked-up
    row, the small LSTM and dense matrices are held dequantized."""

    labels = LABELS

    def __init__(self, folder: Path, precision: str = "int8") -> None:
        weights_path, tokenizer_path = folder / WEIGHTS_FILE, folder / TOKENIZER_FILE
        for p in (weights_path, tokenizer_path):
            if not p.is_file():
                raise ConfigError(f"{p} is missing: a toxic-comment-classifier folder holds "
                                  f"{WEIGHTS_FILE} and {TOKENIZER_FILE}")
        self.name = f"toxic-comment-classifier ({folder.name}, {precision})"
        self.precision = precision
        self.tokenizer = KerasWordTokenizer.read(tokenizer_path)
        w = _read_weights(weights_path)
        try:
            self._build(w, precision)
        except KeyError as e:
            raise ConfigError(f"{weights_path} is not the toxic-comment-classifier BiLSTM's "
                              f"Keras 3 weights (no {e.args[0]})") from e

    def _build(self, w: dict[str, torch.Tensor], precision: str) -> None:
        emb = w["layers/embedding/vars/0"]
        rounded = (lambda m: Int8Rows(m).dequantize()) if precision == "int8" else (lambda m: m)
        self.embedding: Int8Rows | torch.Tensor = Int8Rows(emb) if precision == "int8" else emb
        dim = emb.shape[1]
        units = w["layers/bidirectional/forward_layer/cell/vars/1"].shape[0]
        self.lstm = torch.nn.LSTM(dim, units, batch_first=True, bidirectional=True)
        params = dict(self.lstm.named_parameters())
        with torch.no_grad():
            for keras, suffix in (("forward_layer", ""), ("backward_layer", "_reverse")):
                cell = f"layers/bidirectional/{keras}/cell/vars/"
                # Keras and torch both order the gates input, forget, cell, output.
                params["weight_ih_l0" + suffix].copy_(rounded(w[cell + "0"].T.contiguous()))
                params["weight_hh_l0" + suffix].copy_(rounded(w[cell + "1"].T.contiguous()))
                params["bias_ih_l0" + suffix].copy_(w[cell + "2"])
                params["bias_hh_l0" + suffix].zero_()
        self.lstm.eval()
        self.dense = (rounded(w["layers/dense/vars/0"].T.contiguous()), w["layers/dense/vars/1"])
        self.out = (rounded(w["layers/dense_1/vars/0"].T.contiguous()), w["layers/dense_1/vars/1"])
        if self.out[0].shape[0] != len(LABELS):
            raise ConfigError(f"the classifier has {self.out[0].shape[0]} outputs; the Jigsaw "
                              f"labels are {len(LABELS)}")

    def scores(self, text: str) -> dict[str, float]:
        ids = torch.tensor([self.tokenizer.ids(text, MAX_WORDS)])
        with torch.inference_mode():
            emb = self.embedding
            x = emb.rows(ids) if isinstance(emb, Int8Rows) else emb[ids]
            h = self.lstm(x)[0].amax(dim=1)
            h = torch.relu(torch.nn.functional.linear(h, *self.dense))
            p = torch.sigmoid(torch.nn.functional.linear(h, *self.out))[0]
        return dict(zip(LABELS, p.tolist()))

    def weights_bytes(self) -> int:
        emb = self.embedding
        n = emb.nbytes() if isinstance(emb, Int8Rows) else emb.numel() * emb.element_size()
        n += sum(p.numel() * p.element_size() for p in self.lstm.parameters())
        return n + sum(t.numel() * t.element_size() for t in (*self.dense, *self.out))
