"""The lean tokenizer (tokenizers + jinja2, no transformers import) answers as transformers' tokenizer does for
the same folder: ids, text, added vocabulary, end-of-sequence id and the rendered chat template."""

from __future__ import annotations

import sys

from flashmemory.model.fast_tokenizer import FastTokenizer
from flashmemory.model.tokenizer import Tokenizer

TEXTS = ["Hello, world!", "Caf\u00e9 \u4f60\u597d \U0001f600 done.", "  two  spaces\tand a tab\n\nnew lines",
         "<|im_start|>user\nspecial tokens in text<|im_end|>", "I can't, he's won't. Isn't it?", ""]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye \u00e9\u00e8"}],
]


def _pair(path):
    """(lean, transformers) tokenizers of a checkpoint's tokenizer folder."""
    from transformers import AutoTokenizer

    tokenizer = Tokenizer.from_checkpoint(path, [])
    assert isinstance(tokenizer.backend, FastTokenizer)
    return tokenizer.backend, AutoTokenizer.from_pretrained(str(tokenizer.backend.folder))


def _same(lean, hf):
    assert len(lean) == len(hf)
    assert lean.eos_token_id == hf.eos_token_id
    assert lean.get_added_vocab() == hf.get_added_vocab()
    for text in TEXTS:
        for special in (True, False):
            ids = lean.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert lean.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    if hf.chat_template:
        for chat in CHATS:
            for generation in (True, False):
                assert lean.apply_chat_template(chat, add_generation_prompt=generation) == hf.apply_chat_template(
                    chat, tokenize=False, add_generation_prompt=generation)


def test_the_default_models_tokenizer_matches_transformers(smollm2_path):
    _same(*_pair(smollm2_path))


def test_the_32k_models_tokenizer_matches_transformers(qwen_path):
    _same(*_pair(qwen_path))


def test_a_tiny_folder_with_tokenizer_json_matches_transformers(tiny_llama):
    _same(*_pair(tiny_llama))


def test_the_engine_starts_and_chats_without_importing_transformers(smollm2_path, tmp_path, monkeypatch):
    import subprocess

    monkeypatch.setenv("FLASHMEMORY_CACHE_DIR", str(tmp_path))  # a fresh cache: the first start builds it
    first = Tokenizer.from_checkpoint(smollm2_path, [])
    assert isinstance(first.backend, FastTokenizer)  # read back from the folder it just wrote

    code = ("import sys\nfrom flashmemory import FlashMemoryEngine\ne = FlashMemoryEngine(num_threads=1)\n"
            "ids = e.tokenizer.apply_chat_template([{'role': 'user', 'content': 'Hi'}])\n"
            "assert ids and e.tokenizer.decode(ids)\nprint('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"
