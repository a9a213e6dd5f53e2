"""The real embedded SmolLM2 GGUF: our logits and greedy tokens against transformers loading the same file."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF checkpoints")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
    )
    return model.eval()


def test_logits_over_256_tokens_match_transformers(smollm2_engine, hf_smollm2, alice_text):
    ids = smollm2_engine.tokenizer.encode(alice_text[5000:9000])[:256]
    assert len(ids) == 256
    ours = smollm2_engine.prompt_logits(ids)
    with torch.no_grad():
        theirs = hf_smollm2(torch.tensor([ids])).logits[0].float()
    assert (ours - theirs).abs().max().item() <= 1e-3


def test_32_greedy_tokens_match_transformers(smollm2_engine, hf_smollm2):
    messages = [{"role": "user", "content": "Write two sentences about the sea."}]
    prompt_ids = smollm2_engine.tokenizer.apply_chat_template(messages)
    ours = smollm2_engine.generate_token_ids(prompt_ids, max_new_tokens=32, ignore_eos=True)
    with torch.no_grad():
        out = hf_smollm2.generate(
            torch.tensor([prompt_ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
            pad_token_id=smollm2_engine.tokenizer.hf.pad_token_id,
        )
    theirs = out[0, len(prompt_ids):].tolist()
    assert len(ours) == 32
    assert ours == theirs
