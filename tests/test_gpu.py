"""The sampler, the cache and train.py on a GPU: skipped where torch sees no CUDA device (CI has none).

Run on a GPU machine with `pytest tests/test_gpu.py`. The same checks can be run on the CPU with
`GPU_TESTS_DEVICE=cpu pytest tests/test_gpu.py`, which is how this file's own logic is checked where no
GPU is at hand; it proves nothing about CUDA.
"""
import json
import math
import os

import pytest
import torch

import distill
import sampler
import schedule
import static
import test_distill
import test_policies
import train
from correction import dense_logprobs
from kvcache import KVCache, SparseConfig
from reference import full_forward_logprobs, hf_greedy, masked_dense_logprobs, tiny_model
from sampler import generate

DEVICE = torch.device(os.environ.get("GPU_TESTS_DEVICE", "cuda"))
pytestmark = pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="no CUDA device")

PROMPTS = [[5, 9, 3, 7, 1, 12, 33, 8, 2], [4, 17, 6], [21, 22, 23, 24, 25, 26]]   # left-padded: mixed lengths
EVICTING = ["streaming", "h2o", "snapkv", "rkv", "random"]


def sparse_config(policy):
    if policy == "blocktopk":
        return SparseConfig("blocktopk", budget=4, page_size=4, dense_layers=1)
    return SparseConfig(policy, budget=8, interval=3, window=2, sink=2, kernel=3)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_dense_greedy_equals_hugging_face_in_fp32(arch):
    model = tiny_model(arch).to(DEVICE)
    ours = generate(model, PROMPTS, SparseConfig("full"), max_new_tokens=24, temperature=0)
    assert ours.tokens.device.type == DEVICE.type
    assert torch.equal(ours.tokens, hf_greedy(model, PROMPTS, 24))
    for row, prompt in enumerate(PROMPTS):
        dense = full_forward_logprobs(model, prompt, ours.tokens[row].tolist())
        assert (ours.logprobs[row] - dense).abs().max() < 1e-4


@pytest.mark.parametrize("policy", EVICTING + ["blocktopk"])
def test_eviction_equals_masking_in_fp32(policy):
    model = tiny_model("llama").to(DEVICE)
    out = generate(model, PROMPTS, sparse_config(policy), max_new_tokens=30, temperature=1.0, seed=3, record=True)
    assert (out.logprobs - masked_dense_logprobs(model, out)).abs().max() < 1e-4
    dense = torch.stack([full_forward_logprobs(model, p, out.tokens[i].tolist()) for i, p in enumerate(PROMPTS)])
    assert (out.logprobs - dense).abs().max() > 1e-2                  # eviction really changed something


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("policy", ["full"] + EVICTING + ["blocktopk"])
def test_every_policy_runs_in_bf16_within_its_budget(policy, captured):
    model = tiny_model("qwen3").to(DEVICE, torch.bfloat16)
    sparse = sparse_config(policy)
    out = generate(model, PROMPTS, sparse, max_new_tokens=30, temperature=1.0, seed=1, record=True, captured=captured)
    assert torch.isfinite(out.logprobs).all() and (out.logprobs[out.mask > 0] < 0).all()
    c = model.config                                  # K and V, layers, rows, KV heads, head_dim, 2 bytes in bf16
    per_token = 2 * c.num_hidden_layers * len(PROMPTS) * c.num_key_value_heads * c.head_dim * 2
    assert out.stats["peak_kv_bytes"] == out.stats["peak_kv_tokens"] * per_token
    if policy in EVICTING:
        assert out.stats["peak_kv_tokens"] <= sparse.budget + sparse.interval
        kept = (out.kept[0][1:] >= 0).sum(-1)                        # [steps, N, H_kv] held at each decode step
        assert kept.max() <= sparse.budget + sparse.interval


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA's own sync detector (the CPU has test_sampler's HostReads)")
@pytest.mark.parametrize("record", [False, True])
@pytest.mark.parametrize("policy", ["full"] + EVICTING + ["blocktopk"])
def test_no_eager_decode_step_synchronises_cuda(monkeypatch, policy, record):
    # test_sampler's HostReads imitates this on the CPU, where it cannot tell the cache's host bookkeeping from
    # device work; here CUDA itself raises at any wait for the device in a decode step, start_step's copy of a
    # compression's plan to the device included (a blocking copy would wait)
    calls = []

    def strict(fn, when=lambda *args: True):
        def run(*args, **kwargs):
            if not when(*args):
                return fn(*args, **kwargs)
            calls.append(fn.__name__)
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return run
    monkeypatch.setattr(sampler, "decode", strict(sampler.decode))
    monkeypatch.setattr(KVCache, "start_step", strict(KVCache.start_step, when=lambda cache, pos: bool(cache.layers)))
    out = generate(tiny_model("llama").to(DEVICE), PROMPTS, sparse_config(policy), max_new_tokens=30,
                   temperature=1.0, top_p=0.9, record=record)
    assert calls == ["start_step", "decode"] * 29
    assert out.stats["compressions"] > 0 or policy in ("full", "blocktopk")


@pytest.mark.parametrize("span", [128, 3], ids=["one-graph", "several-graphs"])
@pytest.mark.parametrize("policy", ["full"] + EVICTING + ["blocktopk"])
def test_captured_graph_equals_eager_in_fp32(monkeypatch, policy, span):
    # static.capture: the CUDA graph's replays give the eager path's greedy tokens, and its seeded samples
    # (the same noise is drawn in both paths), on ragged prompts; the graph is really replayed. At static.SPAN's
    # 128 these buffers (9 + 30 slots, or 8 + 3 evicting) take one graph a rollout; at 3, a dense rollout switches
    # between 13 graphs in one memory pool and an evicting one between its spans of 9 and 11 slots
    monkeypatch.setattr(static, "SPAN", span)
    replays = []
    if DEVICE.type == "cuda":
        replay = torch.cuda.CUDAGraph.replay
        monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda graph: replays.append(1) or replay(graph))
    model = tiny_model("llama").to(DEVICE)
    for temperature in (0, 1.0):
        run = lambda captured: generate(model, PROMPTS, sparse_config(policy), max_new_tokens=30,
                                        temperature=temperature, seed=3, captured=captured)
        eager, graph = run(False), run(True)
        assert torch.equal(graph.tokens, eager.tokens)
        assert (graph.logprobs - eager.logprobs).abs().max() < 1e-4
    assert DEVICE.type != "cuda" or len(replays) >= 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_pages_do_not_depend_on_its_batch_mates_on_the_device(dtype):
    # CUDA's sort and topk are other kernels than the CPU's: block top-k's tie rule (a stable sort) checked there
    test_policies.test_a_rows_pages_do_not_depend_on_its_batch_mates(dtype, DEVICE)


@pytest.mark.parametrize("policy", ["snapkv", "blocktopk"])
def test_the_sparse_training_forward_reproduces_the_sampler_on_the_device(policy):
    # --distill's forward: SDPA under one mask per KV head, its K and V expanded over the group's query heads, not
    # copied (distill.masked_attention_forward); in fp32 it must give the sampler's log-probs, and gradients to phi
    model = tiny_model("qwen3").to(DEVICE)
    lora = test_distill.moved_adapter(model)
    with lora.on():
        out = generate(model, PROMPTS, sparse_config(policy), max_new_tokens=24, temperature=1.0, seed=3, record=True)
        logp = distill.sparse_logprobs(model, out)
        (logp * out.mask).sum().backward()
    assert ((logp - out.logprobs) * out.mask).abs().max() < 1e-4
    assert all(b.grad is not None and b.grad.abs().sum() > 0 for b in lora.B.values())


def test_dense_logprobs_equal_the_samplers_with_a_full_cache():
    model = tiny_model("llama").to(DEVICE)
    out = generate(model, PROMPTS, SparseConfig("full"), max_new_tokens=20, temperature=1.0, seed=2)
    logp, topk = dense_logprobs(model, out, batch_size=2, topk=True)
    assert (logp - out.logprobs).abs().max() < 1e-4
    assert (topk - out.topk_logprobs)[out.mask > 0].abs().max() < 1e-4


def test_calibrate_runs_on_the_device_and_reports_what_a_fresh_measure_finds():
    # schedule.py --calibrate --device cuda: measure's alpha and contexts live on the model's device, the blame
    # rule reads them on the host. The rows it reports are the tails of one more measure under its schedule.
    model = tiny_model("llama").to(DEVICE)
    sparse = SparseConfig("snapkv", budget=4, interval=2, window=2, sink=1, kernel=3)
    found, rows = schedule.calibrate(model, PROMPTS * 2, [4, 6, 8, 12, 16], threshold=0.97, bin_size=8,
                                     sparse=sparse, max_new_tokens=24)   # on the CPU: re-measured 3 times
    alpha, contexts = schedule.measure(model, PROMPTS * 2, SparseConfig(**{**vars(sparse), "schedule": found}), 24)
    assert alpha.device.type == DEVICE.type
    tails = schedule.by_bin(alpha, contexts, found, 8)[0]
    assert [r["tail"] for r in rows] == pytest.approx(tails.tolist(), nan_ok=True)


@pytest.mark.parametrize("argv, steps", [([], 3), (["--correction", "sparse-rl", "--policy", "random"], 2),
                                         (["--dtype", "bfloat16"], 2), (["--captured"], 2),
                                         (["--captured", "--dtype", "bfloat16"], 2)],
                         ids=["default", "random-policy", "bf16", "captured", "captured-bf16"])
def test_train_runs_on_the_device(tmp_path, argv, steps):
    train.main(argv + ["--device", DEVICE.type, "--steps", str(steps), "--out", str(tmp_path)])
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, steps + 1))
    assert all(math.isfinite(line["loss"]) and line["peak_kv_bytes"] < line["dense_kv_bytes"] for line in lines)
    assert (tmp_path / f"step-{steps:06d}" / "model.safetensors").is_file()
