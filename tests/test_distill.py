"""distill.py: the adapter starts as the identity and never touches the dense policy; the sparse training
forward reproduces the sampler; the loss by hand; each optimizer moves only its own weights."""
import copy
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import distill
import models
import tasks
import train
from correction import dense_logprobs
from kvcache import SparseConfig
from reference import tiny_model
from sampler import generate
from tasks import reward_fn

PROMPTS = [[5, 9, 3, 7, 1, 12, 33, 8, 2], [4, 17, 6], [21, 22, 23, 24, 25, 26]]
CONFIGS = {"streaming": SparseConfig("streaming", budget=8, interval=3, window=2, sink=2),
           "h2o": SparseConfig("h2o", budget=8, interval=3, window=2, sink=2),
           "snapkv": SparseConfig("snapkv", budget=8, interval=3, window=2, sink=2, kernel=3),
           "rkv": SparseConfig("rkv", budget=8, interval=3, window=2, sink=2, kernel=3),
           "random": SparseConfig("random", budget=8, interval=3, window=2, sink=2),
           "blocktopk": SparseConfig("blocktopk", budget=4, page_size=4, dense_layers=1)}


def moved_adapter(model, seed=0, alpha=distill.ALPHA):
    """An adapter whose B is no longer zero, as after some training."""
    lora = distill.LoRA(model, rank=4, alpha=alpha)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora.B.values():
            p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return lora


def test_the_adapter_starts_from_its_seed_alone():
    # a --distill run that made its warm-up and one that found it cached drew different numbers before the
    # adapter: its A must come from its own seed, and lie in PEFT's Kaiming-uniform range, |A| <= 1 / sqrt(in)
    model = tiny_model("llama")
    torch.manual_seed(1)
    first = distill.LoRA(model, rank=4, seed=0)
    torch.rand(1000)                                                   # whatever else drew in between
    again, other = distill.LoRA(model, rank=4, seed=0), distill.LoRA(model, rank=4, seed=1)
    for key, A in first.A.items():
        assert torch.equal(A, again.A[key]) and not torch.equal(A, other.A[key])
        assert A.abs().max() <= 1 / math.sqrt(A.shape[1]) and A.abs().max() > 0.5 / math.sqrt(A.shape[1])


def test_a_zero_adapter_changes_nothing():
    model = tiny_model("llama")
    sparse = CONFIGS["snapkv"]
    plain = generate(model, PROMPTS, sparse, max_new_tokens=20, seed=1)
    lora = distill.LoRA(model, rank=4)
    assert len(lora.A) == 2 * 7                                       # q k v o gate up down, in each layer
    with lora.on():
        adapted = generate(model, PROMPTS, sparse, max_new_tokens=20, seed=1)
        dense_on = dense_logprobs(model, adapted)
    assert torch.equal(plain.tokens, adapted.tokens) and torch.equal(plain.logprobs, adapted.logprobs)
    assert torch.equal(dense_on, dense_logprobs(model, adapted))


def test_the_adapter_adds_alpha_over_rank_times_B_A_x_to_a_linear_layer():
    # by hand on one layer, k_proj (64 -> 32): W x + (alpha / rank) B A x, alpha 16 (Sparrow's) over rank 4; A [4, 64]
    # as PEFT initialises it (Kaiming-uniform, a = sqrt 5: uniform in +-1 / sqrt(64)), B [32, 4] zero
    model = tiny_model("llama")
    lora = distill.LoRA(model, rank=4)
    layer = model.model.layers[1].self_attn.k_proj
    A, B = lora.A["layers/1/self_attn/k_proj"], lora.B["layers/1/self_attn/k_proj"]
    bound = 1 / math.sqrt(64)
    assert A.shape == (4, 64) and 0.9 * bound < A.abs().max() <= bound and B.shape == (32, 4) and not B.any()
    with torch.no_grad():
        B.copy_(torch.randn(32, 4, generator=torch.Generator().manual_seed(0)))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))                  # [3, 64]
    with torch.no_grad():
        assert torch.equal(layer(x), x @ layer.weight.T)                                 # off: the plain layer
        with lora.on():
            assert torch.allclose(layer(x), x @ layer.weight.T + 16 / 4 * (x @ A.T) @ B.T, atol=1e-5)
    # a layer held in bf16 (a model loaded with dtype=bfloat16, no autocast): the update in fp32 (A and B are), added
    # in the layer's dtype. Without .float(), bf16 x @ fp32 A fails; without .to(), the output comes back fp32
    layer.to(torch.bfloat16)
    xb = x.bfloat16()
    xf = xb.float()                                          # the reference: the same (rounded) inputs in fp32
    with torch.no_grad(), lora.on():
        y = layer(xb)
    assert y.dtype == torch.bfloat16
    assert torch.allclose(y.float(), xf @ layer.weight.float().T + 16 / 4 * (xf @ A.T) @ B.T, atol=5e-2)


def test_the_dense_policy_never_sees_the_adapter(tmp_path):
    model = tiny_model("qwen3")
    bare = copy.deepcopy(model)
    lora = moved_adapter(model)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, bare(ids).logits)       # attached but off: bit for bit
        with lora.on():
            assert not torch.allclose(model(ids).logits, bare(ids).logits)
    model.save_pretrained(tmp_path)                                    # the policy folder holds no adapter
    loaded = type(model).from_pretrained(tmp_path)
    assert set(loaded.state_dict()) == set(bare.state_dict())
    lora.save(tmp_path / "adapter.safetensors")
    again = distill.LoRA(loaded, rank=4)
    again.load(tmp_path / "adapter.safetensors")
    with torch.no_grad(), lora.on(), again.on():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_an_adapter_file_brings_back_its_rank_and_weights(tmp_path):
    model, fresh = tiny_model("llama"), tiny_model("llama")                              # the same theta twice
    lora = distill.LoRA(model, rank=3)
    with torch.no_grad():
        for p in lora.B.values():
            p.normal_(0, 0.05)
    lora.save(tmp_path / "adapter.safetensors")
    again = distill.LoRA.from_file(fresh, tmp_path / "adapter.safetensors")
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad(), lora.on(), again.on():
        assert again.rank == 3 and torch.equal(fresh(ids).logits, model(ids).logits)
    (tmp_path / "notes.txt").write_text("not an adapter")                       # a wrong file, another model's
    for path, other in ((tmp_path / "notes.txt", fresh), (tmp_path / "adapter.safetensors", tiny_model("llama",
                                                                                              num_hidden_layers=4))):
        with pytest.raises(ValueError, match=f"{path.name} is not a DistillSparse adapter of this model"):
            distill.LoRA.from_file(other, path)
    # the 4-layer model's refused adapter had hooked its 28 linear layers, and its hooks and A, B stayed there,
    # called at every forward pass; a refused file leaves the model as it was
    hooks = lambda m: sum(len(layer._forward_hooks) for layer in m.modules())
    assert hooks(other) == 0 and hooks(fresh) == 7 * 2                   # fresh: `again`'s, on its 2 layers


@pytest.mark.parametrize("policy", list(CONFIGS))
def test_the_sparse_training_forward_reproduces_the_sampler(policy):
    model = tiny_model("llama")
    lora = moved_adapter(model)
    with lora.on():
        out = generate(model, PROMPTS, CONFIGS[policy], max_new_tokens=30, temperature=1.0, seed=3, record=True)
        logp = distill.sparse_logprobs(model, out)
    assert (logp - out.logprobs).abs().max() < 1e-4
    assert logp.requires_grad
    with torch.no_grad():                                             # and the sparsity matters: dense differs
        assert (dense_logprobs(model, out) - out.logprobs).abs().max() > 1e-2


def test_the_sparse_training_forward_reproduces_a_sliding_window_sampler():
    # Mistral with a window of 6, narrower than what the cache keeps (8): the training mask must hide the keys at or
    # before p - 6 exactly as the sampler's attention does
    model = tiny_model("mistral", sliding_window=6)
    lora = moved_adapter(model)
    with lora.on():
        out = generate(model, PROMPTS, CONFIGS["streaming"], max_new_tokens=20, seed=3, record=True)
        logp = distill.sparse_logprobs(model, out)
    assert (logp - out.logprobs).abs().max() < 1e-4


def test_the_sparse_forward_needs_what_the_sampler_kept():
    model = tiny_model("llama")
    out = generate(model, PROMPTS, CONFIGS["snapkv"], max_new_tokens=5)
    with pytest.raises(ValueError, match="record=True"):
        distill.sparse_logprobs(model, out)


@pytest.mark.parametrize("other", [dict(num_hidden_layers=3), dict(num_key_value_heads=1)])
def test_rollouts_another_model_recorded_are_refused_by_name(other):
    # a 2-layer, 2-KV-head model's record read by a 3-layer model raised "list index out of range" inside its third
    # layer's attention; by a 1-KV-head model, a reshape's "shape '[3, 1, 1, 29, 16]' is invalid"
    out = generate(tiny_model("llama"), PROMPTS, CONFIGS["snapkv"], max_new_tokens=5, record=True)
    theirs = f"{other.get('num_hidden_layers', 2)} x {other.get('num_key_value_heads', 2)}"
    with pytest.raises(ValueError, match=f"recorded by a model of 2 layers x 2 KV heads, this one has {theirs}"):
        distill.sparse_logprobs(tiny_model("llama", **other), out)


def test_the_distillation_loss_by_hand():
    # two responses; the second token of row 0 is padding. KL alone (Sparrow: loss = kl, coefficient 1, whatever
    # lam says): mean over real tokens of k3, k3 = rho - 1 - log rho with rho = pi_dense_old / pi_sparse+phi
    from sampler import Rollouts
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    rollouts = Rollouts([[1], [1]], torch.zeros(2, 2, dtype=torch.long), mask, torch.zeros(2, 2),
                        torch.zeros(2, 2, 1), torch.zeros(2, 2, 1))
    logp = torch.tensor([[-1.0, -9.0], [-2.0, -0.5]], requires_grad=True)
    logp_old = torch.tensor([[-1.5, 0.0], [-1.0, -0.5]])
    k3 = lambda d: math.exp(d) - 1 - d                                  # d = log rho
    kl = (k3(-0.5) + k3(1.0) + k3(0.0)) / 3
    for lam in (0.5, 1e-3):
        loss, stats = distill.distill_loss(logp, rollouts, logp_old, torch.tensor([1.0, -1.0]), "kl", lam=lam)
        assert loss.item() == pytest.approx(kl, rel=1e-5) and stats["kl"] == pytest.approx(kl, rel=1e-5)
    loss.backward()
    assert logp.grad[0, 1] == 0 and (logp.grad[mask > 0] != 0).sum() == 2   # log rho 0: no KL gradient
    # d k3 / d logp = 1 - rho (rho = exp(logp_old - logp)): at -0.5 -> 1 - e^-0.5, at 1.0 -> 1 - e
    assert logp.grad[0, 0].item() == pytest.approx((1 - math.exp(-0.5)) / 3, rel=1e-5)
    assert logp.grad[1, 0].item() == pytest.approx((1 - math.e) / 3, rel=1e-5)
    # "ppo-kl" at the default lambda, 1e-3: the on-policy PPO term, -A token-mean = (-1 + 1 + 1) / 3, plus 1e-3 * KL
    loss, stats = distill.distill_loss(logp, rollouts, logp_old, torch.tensor([1.0, -1.0]))
    assert loss.item() == pytest.approx(1 / 3 + 1e-3 * kl, rel=1e-6) and stats["kl"] == pytest.approx(kl, rel=1e-5)


@pytest.mark.parametrize("lam", [-1.0, float("nan"), float("inf")])
def test_a_negative_nan_or_infinite_lambda_is_named_as_lam(lam):
    # inf passed: inf * KL is NaN wherever the KL is 0 (the first PPO epoch's), and the adapter's gradients with it
    from sampler import Rollouts
    rollouts = Rollouts([[1]], torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2), torch.zeros(1, 2),
                        torch.zeros(1, 2, 1), torch.zeros(1, 2, 1))
    with pytest.raises(ValueError, match=f"^lam, the KL term's weight, must be a finite number >= 0, got {lam}$"):   # was: kl_coef
        distill.distill_loss(torch.zeros(1, 2), rollouts, torch.zeros(1, 2), torch.ones(1), lam=lam)


def test_the_adapters_ppo_term_is_on_policy_whatever_the_sampler_recorded():
    # Sparrow's old policy is the sparse forward's own log-probs, detached: ratio 1, gradient -A / tokens on
    # every real token, however far the log-probs the sampler recorded (before theta's step) lie from them
    from sampler import Rollouts
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    logp = torch.tensor([[-1.0, -9.0], [-2.0, -0.5]], requires_grad=True)
    for recorded in (logp.detach().clone(), logp.detach() - 0.7, logp.detach() + 2.0):
        rollouts = Rollouts([[1], [1]], torch.zeros(2, 2, dtype=torch.long), mask, recorded,
                            torch.zeros(2, 2, 1), torch.zeros(2, 2, 1))
        logp.grad = None
        ppo, _ = distill.distill_loss(logp, rollouts, logp.detach(), torch.tensor([1.0, -1.0]), "ppo-kl", lam=0.0)
        ppo.backward()
        assert ppo.item() == pytest.approx((-1 + 1 + 1) / 3, rel=1e-6)   # -r A token-mean, r = 1
        assert torch.allclose(logp.grad, torch.tensor([[-1 / 3, 0.0], [1 / 3, 1 / 3]]))


@pytest.mark.parametrize("variant, lam", [("ppo-kl", 0.05), ("kl", distill.LAMBDA)])
def test_one_adapter_step_over_micro_batches_is_one_step_over_the_batch(variant, lam):
    # rows of 12, 5 and 9 response tokens [3, 12]. Reference: the whole batch's token-mean loss in one forward, its
    # gradient clipped to norm 1, one SGD step (lr 1). Micro-batches of 1 and of 3 rows must take that step, report
    # that loss and KL, freeze theta (no gradient lands on it) and leave no gradient behind on phi. At the sampler's
    # temperature 0.7 (--temperature), which the step's sparse forward must score at (at 1.0: another loss). With
    # --distill and a --distill-lambda not the defaults: a step that dropped either still passed at ppo-kl, 1e-3
    model = tiny_model("llama")
    lora = moved_adapter(model)
    with lora.on():
        out = generate(model, PROMPTS, CONFIGS["snapkv"], max_new_tokens=12, temperature=0.7, seed=5, record=True)
    out.mask = out.mask.clone()
    out.mask[1, 5:], out.mask[2, 9:] = 0, 0
    logp_old, advantages = dense_logprobs(model, out, temperature=0.7), torch.tensor([4.0, -2.0, 1.0])
    start = {k: v.detach().clone() for k, v in lora.state_dict().items()}
    with lora.on():
        logp = distill.sparse_logprobs(model, out, temperature=0.7)
        loss, stats = distill.distill_loss(logp, out, logp_old, advantages, variant, lam)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(lora.parameters(), 1.0)
    assert norm > 1 or variant == "kl"                  # the clip acts (the KL alone: a gradient under norm 1)
    expected = {k: start[k] - p.grad for k, p in lora.named_parameters()}
    model.zero_grad(set_to_none=True)                                   # the reference's backward reached theta
    for micro in (1, 3):
        lora.load_state_dict(start)
        lora.zero_grad(set_to_none=True)
        args = SimpleNamespace(micro_batch=micro, dtype="float32", temperature=0.7, distill=variant,
                               distill_lambda=lam)
        metrics = distill.step(model, lora, torch.optim.SGD(lora.parameters(), lr=1.0), out, logp_old, advantages,
                               args)
        assert metrics["distill_loss"] == pytest.approx(loss.item(), rel=1e-5)
        assert metrics["distill_kl"] == pytest.approx(stats["kl"], rel=1e-5)
        assert all(torch.allclose(p, expected[k], atol=1e-6) for k, p in lora.named_parameters())
        assert all(p.grad is None for p in model.parameters()) and all(p.grad is None for p in lora.parameters())


SMALL = ["--task", "sort", "--digits", "4", "8", "--warmup-steps", "80", "--max-new-tokens", "10", "--eval-size", "32",
         "--prompts", "4", "--group-size", "4", "--budget", "10", "--interval", "2", "--window", "2",
         "--distill", "ppo-kl", "--lora-rank", "4"]


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    out = tmp_path_factory.mktemp("warm")
    train.load_model(train.parse_args(SMALL + ["--out", str(out)]), torch.device("cpu"))
    return out / "warmup"


def test_theta_and_phi_each_move_only_in_their_own_step(warm, monkeypatch):
    args = train.parse_args(SMALL)
    model, tokenizer = models.load_pretrained(str(warm))
    lora = distill.LoRA(model, args.lora_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lora_opt = torch.optim.AdamW(lora.parameters(), lr=1e-3)
    weights = lambda module: torch.cat([p.detach().flatten().clone() for p in module.parameters()])
    seen = {}
    real_update, real_step = train.update, distill.step

    def spy(name, real):
        def wrapper(*a, **k):
            before = (weights(model), weights(lora))
            out = real(*a, **k)
            seen[name] = [(before[0] - weights(model)).abs().max().item(), (before[1] - weights(lora)).abs().max().item()]
            return out
        return wrapper
    monkeypatch.setattr(train, "update", spy("theta", real_update))
    monkeypatch.setattr(distill, "step", spy("phi", real_step))
    line = train.rl_step(model, None, opt, tokenizer, train.make_examples("sort", 4, 5, 4, 8), reward_fn("sort"),
                         train.sparse_config(args), args, 3, lora, lora_opt)
    assert seen["theta"][0] > 0 and seen["theta"][1] == 0             # the update moves theta only
    assert seen["phi"][0] == 0 and seen["phi"][1] > 0                 # the adapter's step moves phi only
    assert {"distill_loss", "distill_kl", "distill_s"} <= set(line)
    assert all(p.requires_grad for p in model.parameters())           # theta is trainable again afterwards


def test_a_rank_wider_than_every_layer_is_refused_before_allocating():
    model = models.toy_model(tasks.char_tokenizer())                  # 128 wide: min(in, out) at most 128
    assert distill.LoRA(model, 128).rank == 128
    for rank in (129, 0, 2.5, True):                                   # True is no rank 1
        with pytest.raises(ValueError) as error:
            distill.LoRA(model, rank)
        assert str(error.value) == ("the LoRA rank (--lora-rank) must be an integer from 1 to 128 (min(in, out) of "
                                    f"the model's widest linear layer), got {rank}")
    for alpha in (0, -16, float("nan"), float("inf"), "16", True):    # 0: an adapter that never learns (B's grad 0)
        with pytest.raises(ValueError, match=rf"^the LoRA alpha must be a positive number \(Sparrow's: 16\), got "):
            distill.LoRA(model, 8, alpha=alpha)


def test_an_adapter_file_keeps_its_alpha(tmp_path):
    # the update is (alpha / rank) B A x: a file loaded back with another alpha would compute another function
    model, fresh = tiny_model("llama"), tiny_model("llama")
    lora = moved_adapter(model, alpha=8)
    lora.save(tmp_path / "adapter.safetensors")
    again = distill.LoRA.from_file(fresh, tmp_path / "adapter.safetensors")
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad(), lora.on(), again.on():
        assert again.alpha == 8 and torch.equal(fresh(ids).logits, model(ids).logits)
    with pytest.raises(ValueError, match="holds an adapter of alpha 8.0, this one has alpha 16$"):
        distill.LoRA(tiny_model("llama"), lora.rank).load(tmp_path / "adapter.safetensors")
    save_file({k: p.detach() for k, p in lora.tensors().items()}, str(tmp_path / "old.safetensors"))   # no metadata
    assert distill.LoRA.from_file(tiny_model("llama"), tmp_path / "old.safetensors").alpha == 16   # written before


def test_loading_refuses_another_models_adapter_and_a_damaged_file(tmp_path):
    # copy_ broadcasts: without the checks, a 4-layer file filled a 2-layer adapter (layers 2-3 dropped) and an
    # A cut to [rank, 1] filled [rank, in] with one value per row, with no error
    path = tmp_path / "adapter.safetensors"
    distill.LoRA(tiny_model("llama", num_hidden_layers=4), 4).save(path)
    with pytest.raises(ValueError, match="adapter.safetensors holds an adapter of another model: 56 tensors, this "
                                         "one 28"):
        distill.LoRA(tiny_model("llama"), 4).load(path)
    distill.LoRA(tiny_model("llama"), 2).save(path)          # another --lora-rank: named, with what to resume with
    with pytest.raises(ValueError, match=r"holds a rank-2 adapter, this one has rank 4 \(train.py: resume with the "
                                         r"--lora-rank it was trained with\)$"):
        distill.LoRA(tiny_model("llama"), 4).load(path)
    lora = distill.LoRA(tiny_model("llama"), 4)
    tensors = {k: p.detach().clone() for k, p in lora.tensors().items()}
    tensors["A.layers/0/self_attn/k_proj"] = tensors["A.layers/0/self_attn/k_proj"][:, :1].contiguous()
    save_file(tensors, str(path), metadata={"alpha": "16"})
    with pytest.raises(ValueError, match=r"another model: no A.layers/0/self_attn/k_proj of shape \[4, 64\]$"):
        lora.load(path)
    path.write_bytes(path.read_bytes()[:100])                          # a truncated file
    with pytest.raises(ValueError, match="^cannot read .*adapter.safetensors: "):
        lora.load(path)


def test_the_sparse_training_forward_reproduces_a_sampler_at_temperature_0_7():
    # train.py --temperature 0.7 samples from softmax(logits / 0.7) and records those log-probs; the adapter's
    # forward must score the tokens at that temperature too (with 1.0 in its place it gave log-probs 0.1+ off,
    # and no test at the default temperature 1 could tell). Reference: the sampler's own recorded log-probs
    model = tiny_model("llama")
    lora = moved_adapter(model)
    with lora.on():
        out = generate(model, PROMPTS, CONFIGS["snapkv"], max_new_tokens=20, temperature=0.7, seed=3, record=True)
        logp = distill.sparse_logprobs(model, out, temperature=0.7)
        at_one = distill.sparse_logprobs(model, out, temperature=1.0)
    assert (logp - out.logprobs).abs().max() < 1e-4
    assert ((at_one - out.logprobs) * out.mask).abs().max() > 1e-2     # the temperature matters here


def test_an_adapter_saved_with_a_numpy_alpha_reads_back(tmp_path):
    # alpha from a numpy sweep passes the check (np.float64 is a float), but its repr, 'np.float64(16.0)', was written
    # to the file's metadata, and reading it back failed: float() of that text is no number
    model = tiny_model("llama")
    lora = moved_adapter(model, alpha=np.float64(16.0))
    lora.save(tmp_path / "adapter.safetensors")
    again = distill.LoRA.from_file(tiny_model("llama"), tmp_path / "adapter.safetensors")
    assert again.alpha == 16.0 and again.scaling == 4.0
    distill.LoRA(tiny_model("llama"), 4).load(tmp_path / "adapter.safetensors")      # alpha 16 (int) agrees


def test_a_nested_on_block_leaves_the_adapter_on_for_the_outer_block():
    # an inner `with lora.on()` (a helper that samples with the adapter, called inside an adapted block) used to
    # switch the adapter off at its end, so the rest of the outer block ran theta alone. Reference: k_proj by hand,
    # W x + (alpha / rank) B A x
    model = tiny_model("llama")
    lora = moved_adapter(model)
    layer, key = model.model.layers[0].self_attn.k_proj, "layers/0/self_attn/k_proj"
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    adapted = x @ layer.weight.T + 16 / 4 * (x @ lora.A[key].T) @ lora.B[key].T
    with torch.no_grad():
        with lora.on():
            with lora.on():
                assert torch.allclose(layer(x), adapted, atol=1e-5)
            assert torch.allclose(layer(x), adapted, atol=1e-5)                  # still theta + phi
        assert torch.equal(layer(x), x @ layer.weight.T) and not lora.active      # off after the outer block


def test_the_module_docstrings_example_scores_with_theta_plus_phi():
    # the example's sparse_logprobs line says "theta + phi, the sampler's sparsity", but it stood after the
    # `with lora.on()` block, where the adapter is off: once phi has moved, it scored theta alone. Reference: the
    # sampler's own log-probs, recorded with theta + phi (B moved, as after some steps of training)
    model = tiny_model("llama")
    lines = distill.__doc__.split("\n")
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("lora = LoRA("))
    end = next(i for i in range(start, len(lines)) if lines[i].strip().startswith("loss, stats = distill_loss("))
    example = "\n".join(line[4:].split("#")[0].rstrip() for line in lines[start:end + 1])
    scope = dict(LoRA=lambda model, rank: moved_adapter(model), generate=generate, model=model, prompts=PROMPTS,
                 sparse=CONFIGS["snapkv"], sparse_logprobs=distill.sparse_logprobs, distill_loss=distill.distill_loss,
                 logp_old=torch.zeros(3, 20), advantages=torch.ones(3))
    exec(example.replace("record=True)", "record=True, max_new_tokens=20)"), scope)
    assert scope["lora"].B["layers/0/self_attn/q_proj"].any()
    assert ((scope["logp"] - scope["rollouts"].logprobs) * scope["rollouts"].mask).abs().max() < 1e-4


def test_a_save_that_fails_midway_keeps_the_adapter_file_that_was_there(tmp_path, monkeypatch):
    # save wrote the safetensors file in place: a write cut short (a full disk, a kill) left the old adapter torn,
    # and load could read neither it nor the new one. Reference: the adapter saved before, loaded back bit for bit
    path = tmp_path / "adapter.safetensors"
    model = tiny_model("llama")
    before = moved_adapter(model, seed=0)
    before.save(path)
    real = distill.save_file

    def cut_short(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        Path(filename).write_bytes(Path(filename).read_bytes()[:100])
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(distill, "save_file", cut_short)
    with pytest.raises(OSError, match="No space left"):
        moved_adapter(model, seed=1).save(path)
    again = distill.LoRA(tiny_model("llama"), 4)
    again.load(path)
    assert all(torch.equal(p, before.tensors()[k]) for k, p in again.tensors().items())
    assert [p.name for p in tmp_path.iterdir()] == ["adapter.safetensors"]        # nothing half-written left beside


def test_loading_a_file_that_holds_no_adapter_says_so(tmp_path):
    # a safetensors file of other tensors (a model's weights) was refused as "a rank-None adapter", with the advice to
    # resume with another --lora-rank: no rank would have done
    path = tmp_path / "model.safetensors"
    save_file({"lm_head.weight": torch.zeros(64, 64)}, str(path))
    with pytest.raises(ValueError) as error:
        distill.LoRA(tiny_model("llama"), 4).load(path)
    assert str(error.value) == f"{path} holds no adapter: none of its 1 tensors is an A.<layer> (rank x in)"


@pytest.mark.parametrize("variant", ["ppo-kl", "kl"])
def test_a_misshapen_logp_old_is_named_as_logp_old(variant):
    # policy_loss receives it as logp_ref (its own logp_old is the forward's log-probs, detached), and its error named
    # logp_ref, an argument distill_loss does not have
    from sampler import Rollouts
    rollouts = Rollouts([[1], [1]], torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3), torch.zeros(2, 3),
                        torch.zeros(2, 3, 1), torch.zeros(2, 3, 1))
    with pytest.raises(ValueError, match=r"^logp_old has shape \(2, 2\), expected \(2, 3\) like logp$"):
        distill.distill_loss(torch.zeros(2, 3), rollouts, torch.zeros(2, 2), torch.ones(2), variant)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])                      # G = 1, 2, 4 query heads per KV head
def test_the_sparse_forward_builds_one_layers_mask_at_a_time_and_never_repeats_it(kv_heads):
    # all layers' [N, H_kv, L, L] masks were built before the forward (Qwen3-1.7B, 28 layers, L ~4300: ~4 GB a row),
    # then repeated over a group's G query heads. Counted: the bool tensors as big as a mask. Values: the sampler's
    model, events = tiny_model("llama", num_hidden_layers=3, num_key_value_heads=kv_heads), []
    out = generate(model, PROMPTS, CONFIGS["snapkv"], max_new_tokens=12, seed=3, record=True)
    size = len(PROMPTS) * kv_heads * (max(map(len, PROMPTS)) + out.tokens.shape[1]) ** 2          # N H_kv L^2

    class Builds(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            t = func(*args, **(kwargs or {}))
            events.extend([t.numel()] if torch.is_tensor(t) and t.dtype == torch.bool and t.numel() >= size else [])
            return t
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(lambda *_: events.append("attention"))
    with Builds():
        logp = distill.sparse_logprobs(model, out)
    logp.sum().backward()
    assert (logp - out.logprobs).abs().max() < 1e-4 and all(p.grad.any() for p in model.parameters())   # grad flows
    marks = [i for i, e in enumerate(events) if e == "attention"] + [len(events)]
    per_layer = [events[a + 1:b] for a, b in zip(marks, marks[1:])]   # none before layer 0's, the same in each layer,
    assert marks[0] == 0 and len(per_layer) == 3 and per_layer[0] == per_layer[1] == per_layer[2] != []
    assert max(per_layer[0]) < 2 * size                               # and one [N, H_kv, L, L + 1] at most, never G


@pytest.mark.parametrize("window", [None, 2])
def test_the_masked_attention_scales_by_the_layers_scaling_and_maps_query_head_h_to_kv_head_h_over_g(window):
    # Pins masked_attention_forward alone: the tiny models' scaling is SDPA's default 1 / sqrt(D), so a dropped
    # `scale=scaling` (a model with its own scaling, Gemma's query_pre_attn_scalar) passed every sampler test.
    # Reference: a plain loop, softmax(q_h k_kv^T * scaling) v_kv under the mask, kv = h // G, and with a sliding
    # window key j visible to query i only where j > i - window (the sampler's rule)
    g = torch.Generator().manual_seed(0)
    N, H, H_kv, L, D, scaling = 2, 4, 2, 6, 8, 0.3
    q, k, v = (torch.randn(N, h, L, D, generator=g) for h in (H, H_kv, H_kv))
    mask = (torch.rand(N, H_kv, L, L, generator=g) > 0.4) | torch.eye(L, dtype=torch.bool)
    out, _ = distill.masked_attention_forward(SimpleNamespace(layer_idx=1), q, k, v, None, scaling=scaling,
                                              layer_masks={1: mask}, sliding_window=window)
    assert out.shape == (N, L, H, D)
    for n in range(N):
        for h in range(H):
            kv = h // (H // H_kv)
            for i in range(L):
                seen = [j for j in range(L) if mask[n, kv, i, j] and (window is None or j > i - window)]
                weights = torch.softmax(torch.stack([q[n, h, i] @ k[n, kv, j] * scaling for j in seen]), 0)
                expected = sum(w * v[n, kv, j] for w, j in zip(weights, seen))
                assert torch.allclose(out[n, i, h], expected, atol=1e-5)


def test_an_unknown_distillation_variant_is_refused_by_name():
    # Pins distill_loss's check: without it a mistyped variant ("KL") silently trained with ppo-kl's loss
    from sampler import Rollouts
    rollouts = Rollouts([[1]], torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2), torch.zeros(1, 2),
                        torch.zeros(1, 2, 1), torch.zeros(1, 2, 1))
    with pytest.raises(ValueError, match="^the distillation variant must be 'ppo-kl' or 'kl', got 'KL'$"):
        distill.distill_loss(torch.zeros(1, 2), rollouts, torch.zeros(1, 2), torch.ones(1), "KL")


def test_no_query_of_the_sparse_forward_is_left_without_a_key_on_a_backend_that_gives_nan(monkeypatch):
    # each query also sees its own key (SparseMasks' diagonal): a padding query past a short prompt's row (3 + 20 of
    # L = 9 + 20 coordinates) under a window of 6 sees nothing else. This CPU's SDPA returns 0 for a query with no
    # key, but a plain softmax (older math SDPA, some CUDA kernels) returns NaN, which reaches the loss (NaN * 0)
    def plain_sdpa(q, k, v, attn_mask, scale):                        # softmax over -inf everywhere: NaN
        scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~attn_mask, float("-inf"))
        return scores.softmax(-1) @ v
    model = tiny_model("mistral", sliding_window=6)
    lora = moved_adapter(model)
    with lora.on():
        out = generate(model, PROMPTS, CONFIGS["streaming"], max_new_tokens=20, seed=3, record=True)
        monkeypatch.setattr(distill.F, "scaled_dot_product_attention", plain_sdpa)
        logp = distill.sparse_logprobs(model, out)
    assert (logp - out.logprobs).abs().max() < 1e-4                   # NaN anywhere fails this
    (logp * out.mask).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in lora.parameters())
