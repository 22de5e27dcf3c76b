"""Tests for correction.py: every formula against numbers worked out by hand, down-sampling
against brute force, the loss gradient against autograd and finite differences, the dense
re-scoring against a plain forward pass and against the sampler, degenerate and bad input."""
import itertools
import math

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import correction
from correction import (acceptance, dense_logprobs, downsample, group_advantages, importance_weights,
                        mismatch_stats, policy_loss, rejection_mask, response_logprobs)
from kvcache import SparseConfig
from sampler import Rollouts, generate

LN2 = math.log(2)


@pytest.fixture(scope="module")
def tiny_llama():
    """A random 2-layer Llama with grouped-query attention (4 query heads, 2 KV heads)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config).eval()


def hand_rollouts():
    """Three responses of different prompt and response lengths, built without the sampler."""
    g = torch.Generator().manual_seed(1)
    prompts = [[1, 5, 7, 9, 11], [1, 9, 3], [2, 4, 6, 8, 10, 12, 14]]
    lengths = [6, 4, 2]
    tokens = torch.randint(3, 64, (3, 6), generator=g)
    mask = (torch.arange(6) < torch.tensor(lengths)[:, None]).float()
    tokens = tokens.masked_fill(mask == 0, 0)
    topk_ids = torch.randint(0, 64, (3, 6, 5), generator=g)
    return Rollouts(prompts, tokens, mask, torch.zeros(3, 6), torch.zeros(3, 6, 5), topk_ids), lengths


# ----------------------------------------------------------------------------- 1. down-sampling

def brute_force_best_variance(r, m):
    subsets = np.array(list(itertools.combinations(range(len(r)), m)))
    return r[subsets].var(axis=1).max()


@pytest.mark.parametrize("n", range(2, 11))
def test_downsample_max_variance_matches_brute_force(n):
    rng = np.random.default_rng(n)
    groups = [rng.normal(size=n), rng.uniform(0, 1, size=n), rng.integers(0, 2, size=n).astype(float),
              rng.integers(0, 2, size=n).astype(float), rng.integers(0, 3, size=n).astype(float),
              np.zeros(n), np.r_[np.ones(n - 1), 0.0],
              1e8 + rng.uniform(0, 1, size=n)]   # far from 0: sums of r^2 near 1e17 lose the spread (float64)
    rewards = torch.tensor(np.concatenate(groups))
    for m in range(1, n):
        idx = downsample(rewards, n, m).numpy()
        assert idx.shape == (len(groups) * m,)
        for g, r in enumerate(groups):
            kept = idx[g * m:(g + 1) * m]
            assert len(set(kept)) == m and all(g * n <= i < (g + 1) * n for i in kept)
            assert rewards.numpy()[kept].var() == pytest.approx(brute_force_best_variance(r, m), abs=1e-9)


def test_downsample_max_reward_and_random():
    rewards = torch.tensor([0.1, 0.9, 0.5, 0.3, 5.0, 1.0, 3.0, 2.0])
    assert downsample(rewards, 4, 2, rule="max-reward").tolist() == [1, 2, 4, 6]
    # max-variance on the first group [0.1, 0.9, 0.5, 0.3] takes the extremes
    assert downsample(rewards, 4, 2).tolist()[:2] == [0, 1]
    a = downsample(rewards, 4, 3, rule="random", generator=torch.Generator().manual_seed(0))
    b = downsample(rewards, 4, 3, rule="random", generator=torch.Generator().manual_seed(0))
    assert a.tolist() == b.tolist()
    assert len(set(a[:3].tolist())) == 3 and set(a[:3].tolist()) <= {0, 1, 2, 3}
    assert set(a[3:].tolist()) <= {4, 5, 6, 7}
    assert downsample(rewards, 4, 4).tolist() == list(range(8))
    # max-reward ties go to the earliest rows (a stable sort, the same rows on every device), as Python's sort does
    ties = torch.tensor(np.random.default_rng(0).integers(0, 2, 64), dtype=torch.float64)
    expected = sorted(sorted(range(64), key=lambda i: -ties[i].item())[:16])
    assert downsample(ties, 64, 16, rule="max-reward").tolist() == expected


# ----------------------------------------------------------------------------- 2. formulas by hand

def test_acceptance_by_hand():
    p_a, p_b = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.3, 0.5])
    # full vocabulary: 1 - TV = 1 - (0.3 + 0 + 0.3) / 2 = 0.7
    assert acceptance(p_a.log(), p_b.log()).item() == pytest.approx(0.7)
    # two of three ids listed: min(.5,.2) + min(.3,.3) = 0.5 <= 0.7, a lower bound
    assert acceptance(p_a[:2].log(), p_b[:2].log()).item() == pytest.approx(0.5)


def test_mismatch_stats_by_hand():
    rho = torch.tensor([[1.0, 2.0, 0.8], [0.25, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    logp_sparse = torch.full((2, 3), math.log(0.3))
    logp_dense = logp_sparse + rho.log()
    logp_dense[1, 1] = 50.0  # padding, must be ignored
    probs = [([.5, .3, .2], [.2, .3, .5]),   # alpha 0.7
             ([.6, .3, .1], [.6, .3, .1]),   # 1.0
             ([.9, .05, .05], [.1, .1, .1]),  # 0.2
             ([.4, .4, .2], [.4, .2, .2])]   # 0.8
    topk_dense, topk_sparse = torch.zeros(2, 3, 3), torch.zeros(2, 3, 3)
    for (i, t), (a, b) in zip([(0, 0), (0, 1), (0, 2), (1, 0)], probs):
        topk_dense[i, t], topk_sparse[i, t] = torch.tensor(a).log(), torch.tensor(b).log()
    stats = mismatch_stats(logp_dense, logp_sparse, mask, topk_dense, topk_sparse)
    ln08 = math.log(0.8)
    assert stats["tokens"] == 4
    # rho sorted .25 .8 1 2: p05 at 0.15, p95 at 2.85, 1 + 0.85 * (2 - 1); alpha sorted .2 .7 .8 1
    expected = dict(rho_mean=(1 + 2 + 0.8 + 0.25) / 4, rho_min=0.25, rho_max=2.0, rho_p05=0.25 + 0.15 * 0.55,
                    rho_p50=0.9, rho_p95=1 + 0.85 * 1, kl_k1=-(0 + LN2 + ln08 - 2 * LN2) / 4,
                    alpha_mean=(0.7 + 1.0 + 0.2 + 0.8) / 4, alpha_p05=0.2 + 0.15 * 0.5)
    assert {key: stats[key] for key in expected} == pytest.approx(expected, rel=1e-5)
    assert stats["kl_k3"] == pytest.approx(((2 - 1 - LN2) + (0.8 - 1 - ln08) + (0.25 - 1 + 2 * LN2)) / 4, rel=1e-4)
    assert stats["out_of_band"] == pytest.approx(0.5)  # 2.0 and 0.25 lie outside [0.5, 1.5]


def test_mismatch_stats_quantiles_of_more_than_2_24_tokens():
    # torch.quantile refuses more than 2^24 values: a batch of 2^24 + 1 tokens raised a RuntimeError. Here the first
    # 10 % have rho 0.5 and alpha 0.25, the rest rho 1 and alpha 1: p05 lies inside the first 10 %, p50 and p95 not
    n = 2 ** 24 + 1
    low = torch.arange(n) < n // 10
    logp_sparse = torch.zeros(1, n)
    logp_dense = torch.where(low, -LN2, 0.0)[None]
    topk_dense = torch.where(low, math.log(0.25), 0.0)[None, :, None]
    stats = mismatch_stats(logp_dense, logp_sparse, torch.ones(1, n), topk_dense, torch.zeros(1, n, 1))
    assert stats["tokens"] == n
    quantiles = stats["rho_p05"], stats["rho_p50"], stats["rho_p95"], stats["alpha_p05"]
    assert quantiles == pytest.approx((0.5, 1, 1, 0.25))


def test_mismatch_stats_closed_band_and_kl_in_float64():
    logp, mask = torch.zeros(2, 3), torch.ones(2, 3)
    # rho = 1 exactly on either edge of the band is inside it, as rejection_mask keeps it
    assert mismatch_stats(logp, logp, mask, low=1.0, high=2.0)["out_of_band"] == 0
    assert mismatch_stats(logp, logp, mask, low=0.5, high=1.0)["out_of_band"] == 0
    # log rho = x = 2^-12 (exact in fp32) on every token: k3 = e^x - 1 - x = x^2/2 + x^3/6 + ... = 2.98e-8;
    # computed in fp32, e^x rounds to 1 + x and k3 to 0
    x = 2.0 ** -12
    stats = mismatch_stats(logp + x, logp, mask)
    assert stats["kl_k3"] == pytest.approx(x ** 2 / 2 + x ** 3 / 6, rel=1e-6) and stats["kl_k1"] == -x


def test_rejection_mask_token_band_and_veto_by_hand():
    rho = torch.tensor([[1.0, 0.4, 1.2, 1.6],     # 0.4 and 1.6 leave the band
                        [1.0, 5e-5, 1.0, 1.0],    # one rho < 1e-4: the whole response is vetoed
                        [1.49, 0.51, 1e-6, 1e-6],  # tiny rho on padding: no veto
                        [0.3, 2.0, 1.0, 1.0]])    # every token out of band
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0]])
    new_mask, stats = rejection_mask(rho.log(), mask)
    assert new_mask.tolist() == [[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
    assert stats == dict(vetoed=1, emptied=1, dropped_tokens=2 + 3 + 0 + 2, kept_tokens=4)
    assert all(type(v) is int for v in stats.values()), stats   # tensors pass ==, then fail train.py's json.dumps
    assert mask.sum() == 11  # the input is not modified
    # the band is closed: rho (or the geometric mean) exactly on either edge stays; low = 0 keeps even e^-20
    for mode, (low, high, log_rho) in itertools.product(["token", "geometric"],
                                                        [(1.0, 2.0, 0.0), (0.5, 1.0, 0.0), (0.0, 1.0, -1000.0)]):
        new_mask, _ = rejection_mask(torch.full((4, 4), log_rho), mask, veto=0.0, low=low, high=high, mode=mode)
        assert new_mask.equal(mask), (mode, low, high)


def test_rejection_mask_geometric_by_hand():
    rho = torch.tensor([[2.0, 0.5],     # geometric mean 1: kept whole, though each token is out of [0.5, 1.5]
                        [1.1, 1.1],     # 1.1 outside [0.95, 1.05]: rejected
                        [1.0, 1e-5],    # vetoed
                        [1.02, 100.]])  # padding left out of the mean: 1.02, kept
    mask = torch.tensor([[1.0, 1], [1, 1], [1, 1], [1, 0]])
    new_mask, stats = rejection_mask(rho.log(), mask, low=0.95, high=1.05, mode="geometric")
    assert new_mask.tolist() == [[1, 1], [0, 0], [0, 0], [1, 0]]
    assert stats == dict(vetoed=1, emptied=1, dropped_tokens=4, kept_tokens=3)
    assert all(type(v) is int for v in stats.values()), stats


def test_importance_weights_by_hand():
    rho = torch.tensor([[0.5, 1.0, 3.0], [0.5, 7.0, 1.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    log_rho = rho.log().requires_grad_()
    # truncate at 1.5: 0.5 1 1.5 | 0.5, mean 3.5 / 4 = 0.875
    w = importance_weights(log_rho, mask)
    assert not w.requires_grad
    torch.testing.assert_close(w, torch.tensor([[4 / 7, 8 / 7, 12 / 7], [4 / 7, 0, 0]]))
    assert (w.sum() / mask.sum()).item() == pytest.approx(1.0)
    torch.testing.assert_close(importance_weights(log_rho, mask, normalize=False),
                               torch.tensor([[0.5, 1.0, 1.5], [0.5, 0, 0]]))
    # masked IS drops 3.0 instead of clipping it: 0.5 1 0 | 0.5, mean 0.5
    torch.testing.assert_close(importance_weights(log_rho, mask, mode="mask"),
                               torch.tensor([[1.0, 2, 0], [1, 0, 0]]))
    torch.testing.assert_close(importance_weights(log_rho, mask, cap=3.0, normalize=False),
                               torch.tensor([[0.5, 1.0, 3.0], [0.5, 0, 0]]))


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0, 0, 1, 2, 2, 2, 2, 0, 0, 0, 3])
    adv, stats = group_advantages(rewards, 4)
    std1 = math.sqrt(4 * 0.25 / 3)                      # sample std (n - 1) of 1 0 0 1
    std2 = math.sqrt((3 * 0.75 ** 2 + 2.25 ** 2) / 3)     # ... of 0 0 0 3: 1.5
    a = 0.5 / (std1 + 1e-4)
    expected = [a, -a, -a, a, 0, 0, 0, 0,
                -0.75 / (std2 + 1e-4), -0.75 / (std2 + 1e-4), -0.75 / (std2 + 1e-4), 2.25 / (std2 + 1e-4)]
    torch.testing.assert_close(adv, torch.tensor(expected))
    assert stats == dict(groups=3, zero_std_groups=1)
    adv, _ = group_advantages(rewards, 4, scale=False, eps=0.0)  # Dr. GRPO: no std, so eps plays no part
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, -0.75, -0.75, -0.75, 2.25]))
    # equal rewards whose float mean is inexact (0.1 + 0.1 + 0.1 != 0.3) still give exactly zero
    adv, stats = group_advantages(torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64), 3)
    assert adv.tolist() == [0, 0, 0] and stats["zero_std_groups"] == 1 and adv.dtype == torch.float64


def hand_loss_inputs():
    """Response 0: A = +1, r = 1.5 0.5 1.0, w = 1 2 1.  Response 1: A = -1, r = 1.5 0.5 (third token padding)."""
    r = torch.tensor([[1.5, 0.5, 1.0], [1.5, 0.5, 1.0]])
    logp_old = torch.full((2, 3), math.log(0.4))
    logp = (logp_old + r.log()).requires_grad_()
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    weights = torch.tensor([[1.0, 2, 1], [1, 1, 1]])
    return logp, logp_old, torch.tensor([1.0, -1.0]), mask, weights


def test_integer_rewards_give_float_advantages():
    # the rewards' dtype is kept only when it is a float one: long rewards must not truncate A to 0 or +-1
    advantages, _ = group_advantages(torch.tensor([0, 1, 0, 1, 2, 2, 2, 5]), 4)
    assert advantages.dtype == torch.float32
    assert advantages[:4].tolist() == pytest.approx([-0.866, 0.866, -0.866, 0.866], abs=1e-3)   # std sqrt(1/3)
    assert advantages[4:].tolist() == pytest.approx([-0.5, -0.5, -0.5, 1.5], abs=1e-3)          # std 1.5


def test_group_std_is_bessel_corrected_as_the_authors_compute_it():
    # PODS, TRL, verl, slime: torch.std (n - 1). Two rewards {0, 1}: mean 0.5, std sqrt(0.5) = 0.7071,
    # so A = +-0.5 / 0.7071 = +-0.7071 (the population std, 0.5, would give +-1.0)
    advantages, _ = group_advantages(torch.tensor([0.0, 1.0, 1.0, 0.0]), 2)
    assert advantages.tolist() == pytest.approx([-0.5 / (0.5 ** 0.5 + 1e-4), 0.5 / (0.5 ** 0.5 + 1e-4)] * 1
                                                + [0.5 / (0.5 ** 0.5 + 1e-4), -0.5 / (0.5 ** 0.5 + 1e-4)], abs=1e-6)
    # three rewards {0, 0, 3}: mean 1, sample variance (1 + 1 + 4) / 2 = 3
    advantages, _ = group_advantages(torch.tensor([0.0, 0.0, 3.0]), 3)
    assert advantages.tolist() == pytest.approx([-1 / (3 ** 0.5 + 1e-4)] * 2 + [2 / (3 ** 0.5 + 1e-4)], abs=1e-6)
    # a group of one has no spread: A = 0, not NaN
    advantages, _ = group_advantages(torch.tensor([1.0, 0.0]), 1)
    assert advantages.tolist() == [0.0, 0.0]


def test_policy_loss_by_hand():
    logp, logp_old, adv, mask, weights = hand_loss_inputs()
    # max(-rA, -clip(r, 0.8, 1.2)A): resp 0 -> -1.2 (clipped), -0.5, -1 ; weighted -1.2 -1.0 -1.0
    #                                resp 1 ->  1.5, 0.8 (clipped)
    loss, stats = policy_loss(logp, logp_old, adv, mask, weights)
    assert loss.item() == pytest.approx((-3.2 / 3 + 2.3 / 2) / 2, rel=1e-5)
    assert stats["clip_frac"] == pytest.approx(2 / 5)
    assert stats["weight_mean"] == pytest.approx(6 / 5)
    assert stats["ratio_mean"] == pytest.approx(1.0, rel=1e-5)
    assert (stats["tokens"], stats["responses"], stats["signal_tokens"]) == (5, 2, 5)
    # response 0's first token (r = 1.5) rejected: the mean ratio is over the 4 kept, (0.5 + 1 + 1.5 + 0.5) / 4
    kept = mask.clone()
    kept[0, 0] = 0
    _, stats = policy_loss(logp, logp_old, adv, kept, weights, response_mask=mask)
    assert stats["ratio_mean"] == pytest.approx(0.875, rel=1e-5) and stats["tokens"] == 4
    # per-token advantages [N, T]: A = 2 on response 0's third token (r = 1, w = 1) doubles its -1
    loss, _ = policy_loss(logp, logp_old, torch.tensor([[1.0, 1, 2], [-1, -1, -1]]), mask, weights)
    assert loss.item() == pytest.approx((-4.2 / 3 + 2.3 / 2) / 2, rel=1e-5)
    loss, _ = policy_loss(logp, logp_old, adv, mask, weights, agg="token-mean")
    assert loss.item() == pytest.approx((-3.2 + 2.3) / 5, rel=1e-5)
    # a third response, fully rejected, adds 0 and still counts: the mean is over all 3 (slime, PODS)
    pad = lambda x: torch.cat([x, torch.ones_like(x[:1])])
    loss, stats = policy_loss(pad(logp), pad(logp_old), pad(adv), pad(mask) * torch.tensor([[1.0], [1], [0]]),
                              pad(weights), response_mask=pad(mask))
    assert loss.item() == pytest.approx((-3.2 / 3 + 2.3 / 2) / 3, rel=1e-5) and stats["responses"] == 2
    # clip-higher 0.6: r = 1.5 now lies inside [0.8, 1.6], resp 0 -> -1.5 -1.0 -1.0
    loss, _ = policy_loss(logp, logp_old, adv, mask, weights, clip_high=0.6)
    assert loss.item() == pytest.approx((-3.5 / 3 + 2.3 / 2) / 2, rel=1e-5)
    # k3 KL with pi_ref = 2 pi_theta: 2 - 1 - ln 2 per token, added unweighted to every kept token
    logp_ref = logp.detach() + LN2
    loss, stats = policy_loss(logp, logp_old, adv, mask, weights, kl_coef=0.5, logp_ref=logp_ref)
    assert stats["kl"] == pytest.approx(1 - LN2, rel=1e-5)
    assert loss.item() == pytest.approx((-3.2 / 3 + 2.3 / 2) / 2 + 0.5 * (1 - LN2), rel=1e-5)


def loop_loss(logp, logp_old, logp_ref, A, kept, sampled, w, clip, clip_high, kl_coef, agg):
    """docs/method.md section 5 token by token, in plain Python floats:
    L_t = w_t * max(-r A, -clip(r) A) + kl_coef * k3_t on each kept token; seq-mean divides response i by the n_i
    tokens it sampled and the sum by every response, token-mean by all sampled tokens. Tensors [N, T] (A [N]) in,
    a float out."""
    logp, logp_old, logp_ref, A, kept, w = (x.tolist() for x in (logp, logp_old, logp_ref, A, kept, w))
    sums, n = [], sampled.sum(-1).tolist()
    for i in range(len(n)):
        total = 0.0
        for t in range(len(logp[i])):
            if kept[i][t]:
                r = math.exp(logp[i][t] - logp_old[i][t])
                pg = max(-r * A[i], -min(max(r, 1 - clip), 1 + clip_high) * A[i])
                q = math.exp(logp_ref[i][t] - logp[i][t])                          # pi_ref / pi_theta
                total += w[i][t] * pg + kl_coef * (q - 1 - math.log(q))
        sums.append(total)
    if agg == "seq-mean":
        return sum(s / max(k, 1) for s, k in zip(sums, n)) / len(n)
    return sum(sums) / max(sum(n), 1)


def test_policy_loss_equals_a_per_token_loop():
    # random batches with responses of 0 to 5 tokens, random rejection, weights and a KL whose k3 differs per token:
    # the KL term too is summed over the kept tokens only and divided as the policy-gradient term is (the hand test
    # above has k3 equal on every token, where every aggregation gives the same number)
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        N, T = 1 + trial % 4, 1 + trial % 5
        sampled = (torch.arange(T) < torch.randint(0, T + 1, (N,), generator=g)[:, None]).double()
        kept = sampled * torch.randint(0, 2, (N, T), generator=g)
        logp = -torch.rand(N, T, generator=g, dtype=torch.float64) * 3
        logp_old, logp_ref = (logp + torch.randn(N, T, generator=g, dtype=torch.float64) * 0.4 for _ in range(2))
        A, w = torch.randn(N, generator=g, dtype=torch.float64), torch.rand(N, T, generator=g, dtype=torch.float64) * 2
        clip_high = (None, 0.3)[trial % 2]
        for agg in ("seq-mean", "token-mean"):
            loss, _ = policy_loss(logp, logp_old, A, kept, w, 0.2, clip_high, 0.1, logp_ref, agg, response_mask=sampled)
            expected = loop_loss(logp, logp_old, logp_ref, A, kept, sampled, w, 0.2, clip_high or 0.2, 0.1, agg)
            assert loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-12), (trial, agg)


def test_rejection_does_not_enlarge_the_step_of_the_rest():
    # 8 responses of 2 tokens, on-policy (r = 1), A = +-1; rejection vetoes 4 of them. The authors'
    # seq-mean (slime: each response's token mean over its sampled tokens, summed, / global batch 8):
    # d loss / d logp_it = -A_i / (2 * 8) on every kept token, so |grad|_1 = 4 * 2 / 16 = 0.5.
    # Dividing by the 4 responses left would double it (1.0).
    logp = torch.full((8, 2), -1.0, requires_grad=True)
    sampled = torch.ones(8, 2)
    kept = sampled * torch.tensor([1.0, 0, 1, 0, 1, 0, 1, 0])[:, None]
    adv = torch.tensor([1.0, -1, -1, 1, 1, -1, -1, 1])
    grad = grad_of(policy_loss(logp, logp.detach(), adv, kept, response_mask=sampled)[0], logp)
    assert grad.abs().sum().item() == pytest.approx(0.5, rel=1e-6)
    assert grad[0].tolist() == pytest.approx([-1 / 16, -1 / 16]) and grad[1].tolist() == [0.0, 0.0]
    # token-mean (DAPO; slime divides by the response tokens before rejection, 16): the same 0.5
    grad = grad_of(policy_loss(logp, logp.detach(), adv, kept, agg="token-mean", response_mask=sampled)[0], logp)
    assert grad.abs().sum().item() == pytest.approx(0.5, rel=1e-6)
    # one token of response 0 rejected: its mean still divides by the 2 tokens it sampled
    kept[0, 1] = 0
    grad = grad_of(policy_loss(logp, logp.detach(), adv, kept, response_mask=sampled)[0], logp)
    assert grad[0].tolist() == pytest.approx([-1 / 16, 0.0])


# ----------------------------------------------------------------------------- 3. gradients

def random_batch(seed, N=4, T=6, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(N, T, generator=g, dtype=dtype) * 3).requires_grad_()
    lengths = torch.tensor([6, 3, 1, 5])[:N]
    mask = (torch.arange(T) < lengths[:, None]).to(dtype)
    adv = torch.randn(N, generator=g, dtype=dtype)
    return logp, adv, mask, g


def grad_of(loss, x):
    return torch.autograd.grad(loss, x)[0]


def test_policy_loss_on_policy_gradient_is_the_reinforce_gradient():
    logp, adv, mask, _ = random_batch(0)
    loss, stats = policy_loss(logp, logp.detach(), adv, mask)
    assert stats["clip_frac"] == 0 and stats["ratio_mean"] == pytest.approx(1.0)
    reference = (-(adv[:, None] * logp) * mask).sum(-1) / mask.sum(-1)
    torch.testing.assert_close(grad_of(loss, logp), grad_of(reference.mean(), logp))
    loss, _ = policy_loss(logp, logp.detach(), adv, mask, agg="token-mean")
    reference = (-(adv[:, None] * logp) * mask).sum() / mask.sum()
    torch.testing.assert_close(grad_of(loss, logp), grad_of(reference, logp))


def test_policy_loss_weights_scale_and_rejection_zeroes_token_gradients():
    logp, adv, mask, g = random_batch(1)
    weights = (torch.rand(mask.shape, generator=g) * 2).requires_grad_()   # a caller forgot to detach them
    plain = grad_of(policy_loss(logp, logp.detach(), adv, mask)[0], logp)
    weighted, to_weights = torch.autograd.grad(policy_loss(logp, logp.detach(), adv, mask, weights)[0],
                                               [logp, weights], allow_unused=True)
    torch.testing.assert_close(weighted, weights.detach() * plain)
    assert to_weights is None   # the loss detaches w: no gradient reaches it
    rejected = mask.clone()
    rejected[0, 1] = rejected[0, 4] = rejected[3, 0] = 0
    grad = grad_of(policy_loss(logp, logp.detach(), adv, rejected, weights)[0], logp)
    assert grad[rejected == 0].eq(0).all() and grad[rejected > 0].ne(0).all()
    # the loss does not even see a rejected token's log-prob
    moved = logp.detach().clone()
    moved[0, 1] -= 5.0
    before = policy_loss(logp, logp.detach(), adv, rejected, weights)[0]
    assert policy_loss(moved, logp.detach(), adv, rejected, weights)[0] == before


@pytest.mark.parametrize("agg", ["seq-mean", "token-mean"])
def test_policy_loss_gradient_matches_finite_differences(agg):
    logp, adv, mask, g = random_batch(2, dtype=torch.float64)
    # off-policy ratios away from the clip kinks at 0.8 and 1.2, so the loss is smooth around them
    log_r = torch.tensor([-0.6, -0.3, -0.1, 0.05, 0.1, 0.4], dtype=torch.float64)
    logp_old = logp.detach() - log_r[torch.randperm(24, generator=g) % 6].view(4, 6)
    weights = torch.rand(4, 6, generator=g, dtype=torch.float64) + 0.5
    logp_ref = logp.detach() + torch.randn(4, 6, generator=g, dtype=torch.float64) * 0.3
    fn = lambda x: policy_loss(x, logp_old, adv, mask, weights, kl_coef=0.1, logp_ref=logp_ref, agg=agg)[0]
    assert torch.autograd.gradcheck(fn, (logp,))


# ----------------------------------------------------------------------------- 4. degenerate input

def assert_zero_loss_and_gradient(logp, *args, **kwargs):
    loss, stats = policy_loss(logp, *args, **kwargs)
    grad = grad_of(loss, logp)
    assert loss.item() == 0 and torch.isfinite(loss) and grad.eq(0).all()
    return stats


@pytest.mark.parametrize("agg", ["seq-mean", "token-mean"])
def test_every_response_vetoed(agg):
    logp, adv, mask, _ = random_batch(3)
    log_rho = torch.full(mask.shape, -1000.0)
    new_mask, stats = rejection_mask(log_rho, mask)
    assert new_mask.sum() == 0 and stats["vetoed"] == 4 and stats["kept_tokens"] == 0
    weights = importance_weights(log_rho, mask)
    assert torch.isfinite(weights).all()
    loss_stats = assert_zero_loss_and_gradient(logp, logp.detach(), adv, new_mask, weights, agg=agg)
    assert loss_stats["tokens"] == 0 and loss_stats["responses"] == 0


def test_whole_group_rejected_leaves_the_other_group_alone():
    logp, _, mask, _ = random_batch(4)
    log_rho = torch.zeros(mask.shape)
    log_rho[0, 0] = log_rho[1, 2] = -1000.0          # group 0 (rows 0, 1) vetoed
    adv, _ = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 2)  # from all rewards, before rejection
    new_mask, stats = rejection_mask(log_rho, mask)
    assert stats["vetoed"] == 2
    loss, loss_stats = policy_loss(logp, logp.detach(), adv, new_mask, importance_weights(log_rho, mask))
    grad = grad_of(loss, logp)
    assert torch.isfinite(loss) and grad[:2].eq(0).all() and grad[2:][new_mask[2:] > 0].ne(0).all()
    assert loss_stats["responses"] == 2


def test_all_equal_rewards_give_no_signal():
    logp, _, mask, _ = random_batch(5)
    adv, stats = group_advantages(torch.full((4,), 0.7), 4)
    assert stats["zero_std_groups"] == 1 and adv.eq(0).all()
    loss_stats = assert_zero_loss_and_gradient(logp, logp.detach(), adv, mask)
    assert loss_stats["signal_tokens"] == 0 and loss_stats["tokens"] == mask.sum()


def test_extreme_log_rho_stays_finite():
    logp, adv, mask, _ = random_batch(6)
    log_rho = torch.full(mask.shape, 1000.0)
    log_rho[::2] = -1000.0
    new_mask, stats = rejection_mask(log_rho, mask)
    assert new_mask.sum() == 0 and stats["vetoed"] == 2 and stats["emptied"] == 2
    for mode in ("truncate", "mask"):
        assert torch.isfinite(importance_weights(log_rho, mask, mode=mode)).all()
    stats = mismatch_stats(logp.detach() + log_rho, logp.detach(), mask)
    assert all(math.isfinite(v) for v in stats.values())
    # a stale learner whose ratio r is e^{+-1000}: clamped, finite loss and gradient
    loss, _ = policy_loss(logp, logp.detach() - log_rho, adv, mask)
    assert torch.isfinite(loss) and torch.isfinite(grad_of(loss, logp)).all()


@pytest.mark.parametrize("agg", ["seq-mean", "token-mean"])
def test_empty_masks(agg):
    logp, adv, mask, _ = random_batch(7)
    empty = torch.zeros_like(mask)
    with torch.no_grad():
        logp[:, 3:] = float("-inf")  # garbage on padding must not leak
    logp_ref = logp.detach() + 1.0
    stats = mismatch_stats(logp.detach(), logp.detach() - 1.0, empty, torch.zeros(4, 6, 2), torch.zeros(4, 6, 2))
    assert stats["tokens"] == 0 and all(v == 0 for v in stats.values())
    new_mask, reject_stats = rejection_mask(torch.zeros_like(mask), empty)
    assert new_mask.sum() == 0 and reject_stats == dict(vetoed=0, emptied=0, dropped_tokens=0, kept_tokens=0)
    weights = importance_weights(torch.zeros_like(mask), empty)
    assert weights.eq(0).all()
    loss_stats = assert_zero_loss_and_gradient(logp, logp.detach(), adv, empty, weights, kl_coef=0.1,
                                               logp_ref=logp_ref, agg=agg)
    assert loss_stats["tokens"] == 0
    # with the real mask, the -inf on padding still gives a finite loss and gradient
    loss, stats = policy_loss(logp, logp.detach(), adv, mask * (torch.arange(6) < 3), kl_coef=0.1,
                              logp_ref=logp_ref, agg=agg)
    assert torch.isfinite(loss) and torch.isfinite(grad_of(loss, logp)).all()
    assert all(math.isfinite(v) for v in stats.values())


# ----------------------------------------------------------------------------- 5. dense re-scoring

def test_dense_logprobs_equals_a_plain_forward_pass(tiny_llama):
    rollouts, lengths = hand_rollouts()
    logp, topk = dense_logprobs(tiny_llama, rollouts, batch_size=2, temperature=0.7, topk=True)
    assert logp.shape == (3, 6) and topk.shape == (3, 6, 5)
    assert not logp.requires_grad and not topk.requires_grad   # pi_old: no graph kept
    with torch.no_grad():
        for i, (prompt, length) in enumerate(zip(rollouts.prompts, lengths)):
            response = rollouts.tokens[i, :length]
            logits = tiny_llama(torch.tensor([prompt + response.tolist()])).logits[0]
            logp_all = torch.log_softmax(logits[len(prompt) - 1:-1] / 0.7, dim=-1)      # [length, V]
            torch.testing.assert_close(logp[i, :length], logp_all.gather(-1, response[:, None]).squeeze(-1),
                                       atol=1e-5, rtol=0)
            torch.testing.assert_close(topk[i, :length], logp_all.gather(-1, rollouts.topk_ids[i, :length]),
                                       atol=1e-5, rtol=0)
            assert logp[i, length:].eq(0).all()
    # temperature 0 (greedy sampling) is scored at temperature 1
    torch.testing.assert_close(dense_logprobs(tiny_llama, rollouts, 3, temperature=0.0),
                               dense_logprobs(tiny_llama, rollouts, 1, temperature=1.0), atol=1e-5, rtol=0)


def test_response_logprobs_has_gradient_and_matches_dense(tiny_llama):
    rollouts, _ = hand_rollouts()
    tiny_llama.zero_grad()
    logp = response_logprobs(tiny_llama, rollouts)
    logp.sum().backward()
    torch.testing.assert_close(logp.detach(), dense_logprobs(tiny_llama, rollouts, 2), atol=1e-5, rtol=0)
    assert tiny_llama.model.embed_tokens.weight.grad.abs().sum() > 0
    tiny_llama.zero_grad()


def test_chunked_rescoring_equals_one_pass(tiny_llama):
    # the output layer and log-softmax a few positions at a time give what one pass over all T gives,
    # log-probs, top-k and (through the checkpointed chunks) gradients alike
    rollouts, _ = hand_rollouts()
    whole = dense_logprobs(tiny_llama, rollouts, batch_size=3, topk=True, chunk=6)
    for chunk in (1, 4):
        parts = dense_logprobs(tiny_llama, rollouts, batch_size=3, topk=True, chunk=chunk)
        for a, b in zip(parts, whole):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    grads = []
    for chunk in (6, 1):
        tiny_llama.zero_grad()
        (response_logprobs(tiny_llama, rollouts, chunk=chunk) * torch.arange(1.0, 7.0)).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in tiny_llama.parameters() if p.grad is not None]))
    tiny_llama.zero_grad()
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-5)


def test_rescoring_chunk_size_and_checkpointing(tiny_llama, monkeypatch):
    # a hook on the output layer records the positions of each call: by default CHUNK_ELEMENTS // (N * V) positions
    # (at least 1) a chunk; with grad and more than one chunk, each chunk runs again in the backward pass
    rollouts, _ = hand_rollouts()                                                  # N = 3, T = 6, V = 64
    calls = []
    hook = tiny_llama.lm_head.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[1]))
    try:
        monkeypatch.setattr(correction, "CHUNK_ELEMENTS", 3 * 64 * 4)           # 4 positions of 3 rows
        dense_logprobs(tiny_llama, rollouts, batch_size=3)
        dense_logprobs(tiny_llama, rollouts, batch_size=1)                         # 12 positions of 1 row: all 6
        assert calls == [4, 2] + [6] * 3
        monkeypatch.setattr(correction, "CHUNK_ELEMENTS", 1)                      # not one position: 1 anyway
        calls.clear()
        response_logprobs(tiny_llama, rollouts).sum().backward()
        assert calls == [1] * 12                                                   # 6 forward, 6 recomputed
        calls.clear()
        response_logprobs(tiny_llama, rollouts, chunk=6).sum().backward()
        assert calls == [6]                                                        # one chunk: nothing recomputed
    finally:
        hook.remove()
        tiny_llama.zero_grad()


def test_dense_logprobs_matches_the_sampler_only_without_eviction(tiny_llama):
    def sample_and_rescore(config):
        """40 tokens sampled through `config` -> (sampler stats, largest |dense - sampled| log-prob, alpha p05)."""
        out = generate(tiny_llama, [[1, 5, 7, 9, 11], [1, 9, 3], [2, 4, 6, 8, 10, 12, 14]], config,
                       max_new_tokens=40, temperature=0.8, seed=0, logprobs_topk=64)
        logp, topk = dense_logprobs(tiny_llama, out, batch_size=2, temperature=0.8, topk=True)
        alpha_p05 = mismatch_stats(logp, out.logprobs, out.mask, topk, out.topk_logprobs)["alpha_p05"]
        return out.stats, (logp - out.logprobs)[out.mask > 0].abs().max(), alpha_p05

    _, gap, alpha_p05 = sample_and_rescore(SparseConfig("full"))
    assert gap < 1e-4 and alpha_p05 > 1 - 1e-4
    stats, gap, alpha_p05 = sample_and_rescore(SparseConfig("snapkv", budget=8, window=2, sink=2, interval=1))
    assert stats["compressions"] > 0 and gap > 1e-2 and alpha_p05 < 0.999


# ----------------------------------------------------------------------------- 6. bad input

Z = torch.zeros(2, 3)

BAD_INPUT = [
    (lambda: downsample(torch.zeros(8), 4, 5), "m must be .* got 5"),
    (lambda: downsample(torch.zeros(8), 4, 0), "m must be .* got 0"),
    (lambda: downsample(torch.zeros(8), 4, 2, rule="best"), "rule must be .* got 'best'"),
    (lambda: downsample(torch.zeros(7), 4, 2), "7 rewards cannot be split into groups of group_size=4"),
    (lambda: group_advantages(torch.zeros(6), 4), "6 rewards cannot be split into groups of group_size=4"),
    (lambda: group_advantages(torch.zeros(2, 4), 4), r"flat \[N\] tensor, got shape \(2, 4\)"),
    (lambda: group_advantages(torch.zeros(4), 0), "group_size must be a positive integer, got 0"),
    # a NaN reward gave its group NaN advantages (then a NaN loss and NaN weights after the step); max-variance
    # down-sampling took the NaN row as the highest reward
    (lambda: group_advantages(torch.tensor([0.0, 1.0, math.nan, 1.0]), 2), "rewards must be finite, got nan at row 2"),
    (lambda: downsample(torch.tensor([0.0, -math.inf, 1.0, 1.0]), 4, 2), "rewards must be finite, got -inf at row 1"),
    (lambda: rejection_mask(Z, Z, low=1.5, high=0.5), "low < high .* low=1.5, high=0.5"),
    (lambda: rejection_mask(Z, Z, low=1.0, high=1.0), "low=1.0, high=1.0"),
    (lambda: rejection_mask(Z, torch.zeros(2, 4)), r"mask has shape \(2, 4\), expected \(2, 3\)"),
    (lambda: rejection_mask(Z, Z, veto=-1.0), "veto must be >= 0 .* got -1.0"),
    (lambda: rejection_mask(Z, Z, mode="seq"), "mode must be .* got 'seq'"),
    (lambda: importance_weights(Z, Z, cap=0.0), "cap must be > 0, got 0.0"),
    (lambda: importance_weights(Z, Z, cap=-2), "cap must be > 0, got -2"),
    (lambda: importance_weights(Z, Z, mode="clip"), "mode must be .* got 'clip'"),
    (lambda: importance_weights(Z, torch.zeros(3, 2)), r"mask has shape \(3, 2\)"),
    (lambda: policy_loss(Z, Z, torch.zeros(3), Z), r"advantages has shape \(3,\)"),
    (lambda: policy_loss(Z, torch.zeros(2, 4), torch.zeros(2), Z), r"logp_old has shape \(2, 4\)"),
    (lambda: policy_loss(Z, Z, torch.zeros(2), Z, weights=torch.ones(2)), r"weights has shape \(2,\)"),
    (lambda: policy_loss(Z, Z, torch.zeros(2), Z, agg="sum"), "agg must be .* got 'sum'"),
    # the masks swapped (rejected tokens as the denominators): response 1 keeping 3 of 1 token gave 3x its loss
    (lambda: policy_loss(Z, Z, torch.zeros(2), torch.ones(2, 3), response_mask=torch.tensor([[1., 1, 1], [1, 0, 0]])),
     "mask keeps tokens outside response_mask in row 1"),
    (lambda: policy_loss(Z, Z, torch.zeros(2), Z, clip=0), "clip=0"),
    (lambda: policy_loss(Z, Z, torch.zeros(2), Z, kl_coef=0.1), "kl_coef=0.1 needs logp_ref"),
    # nan passes every `x <= 0` test: each setting is checked as `not x > 0`, or it gives nan weights, advantages or
    # loss, or (veto) silently no veto; a negative KL coefficient would push the policy away from the reference
    (lambda: importance_weights(Z, Z, cap=math.nan), "cap must be > 0, got nan"),
    (lambda: rejection_mask(Z, Z, veto=math.nan), r"veto must be >= 0 \(0 disables it\), got nan"),
    (lambda: group_advantages(torch.zeros(4), 2, eps=math.nan), "eps must be > 0 when scale=True, got nan"),
    (lambda: policy_loss(Z, Z, torch.zeros(2), Z, clip=math.nan), "clip=nan, clip_high=None"),
    (lambda: policy_loss(Z, Z, torch.zeros(2), Z, clip_high=math.nan), "clip=0.2, clip_high=nan"),
    (lambda: policy_loss(Z, Z, torch.zeros(2), Z, kl_coef=-0.1, logp_ref=Z), r"kl_coef must be >= 0 .* got -0.1"),
    (lambda: policy_loss(Z, Z, torch.zeros(2), Z, kl_coef=math.nan, logp_ref=Z), r"kl_coef must be >= 0 .* got nan"),
    (lambda: acceptance(torch.zeros(2, 3, 4), torch.zeros(2, 3, 5)), r"topk_logp_b has shape \(2, 3, 5\)"),
    (lambda: mismatch_stats(Z, torch.zeros(3), Z), r"logp_sparse has shape \(3,\)"),
    (lambda: mismatch_stats(Z, Z, Z, topk_dense=torch.zeros(2, 3, 4)), "both topk_dense and topk_sparse"),
    (lambda: mismatch_stats(Z, Z, Z, low=1.5, high=0.5), "low < high .* low=1.5, high=0.5"),
]


@pytest.mark.parametrize("call, message", BAD_INPUT)
def test_bad_input_raises_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_dense_logprobs_rejects_bad_input(tiny_llama):
    rollouts, _ = hand_rollouts()
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        dense_logprobs(tiny_llama, rollouts, batch_size=0)
    with pytest.raises(ValueError, match="temperature must be 0 .* got -1"):
        dense_logprobs(tiny_llama, rollouts, temperature=-1)
    # NaN passes `< 0` and scores every token NaN; inf scores a uniform distribution; 1e-40 overflows logits / T
    # to NaN log-probs; the sampler refuses all three
    for bad in (math.nan, math.inf, 1e-40):
        with pytest.raises(ValueError, match=rf"temperature must be 0 \(greedy\) or a finite number >= 1e-06, "
                                             rf"got {bad}"):
            dense_logprobs(tiny_llama, rollouts, temperature=bad)
    broken = Rollouts(rollouts.prompts, rollouts.tokens, rollouts.mask[:, :4], rollouts.logprobs,
                      rollouts.topk_logprobs, rollouts.topk_ids)
    with pytest.raises(ValueError, match=r"mask has shape \(3, 4\), expected \(3, 6\)"):
        dense_logprobs(tiny_llama, broken)


# ----------------------------------------------------------------------------- 7. the lab's edge cases (LAB.md)
# Mistakes a student writing importance_weights or rejection_mask from the docstring made, or could make, that
# no test above caught: each test below fails on one of them (LAB.md lists them).

def test_importance_weights_mask_mode_keeps_rho_exactly_at_the_cap():
    # rho = exp(0) = 1 exactly, at cap 1: masked IS keeps it (rho <= cap), drops 2 and clips nothing
    log_rho = torch.tensor([[0.0, -LN2, LN2]])            # rho 1, 0.5, 2
    mask = torch.ones(1, 3)
    w = importance_weights(log_rho, mask, cap=1.0, normalize=False, mode="mask")
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.5, 0.0]]))
    torch.testing.assert_close(importance_weights(log_rho, mask, cap=1.0, normalize=False),
                               torch.tensor([[1.0, 0.5, 1.0]]))


def test_importance_weights_clamp_log_rho_at_20_before_the_cap():
    # rho = exp(clamp(log rho, -20, 20)) (docs/method.md section 1): log rho 25 counts as e^20, below a
    # cap of 1e10 (unclamped, e^25 = 7.2e10 would be clipped to 1e10 or, in mask mode, dropped)
    log_rho = torch.tensor([[25.0, 0.0], [-25.0, 0.0]])
    mask = torch.ones(2, 2)
    expected = torch.tensor([[math.exp(20), 1.0], [math.exp(-20), 1.0]])
    for mode in ("truncate", "mask"):   # relative: e^-20 = 2e-9 lies within the default atol of e^-25
        torch.testing.assert_close(importance_weights(log_rho, mask, cap=1e10, normalize=False, mode=mode), expected,
                                   rtol=1e-6, atol=0)
    # no cap at all: log rho 1000 stays e^20, so the normalised weights are finite: 2 e^20 / (e^20 + 1) and
    # 2 / (e^20 + 1), mean 1
    w = importance_weights(torch.tensor([[1000.0, 0.0]]), torch.ones(1, 2), cap=float("inf"))
    e20 = math.exp(20)
    torch.testing.assert_close(w, torch.tensor([[2 * e20 / (e20 + 1), 2 / (e20 + 1)]]))


def test_importance_weights_mask_mode_with_every_rho_above_the_cap_gives_zeros_not_nan():
    # masked IS drops every token here, so the weights sum to 0 over a mask that is not empty: normalising must
    # not divide 0 by 0 (the batch then carries no gradient, as with nothing kept)
    log_rho = torch.tensor([[1.0, 1.0, 0.0], [2.0, 1.0, 0.0]])       # rho e and e^2 > cap 1.5; the 0s are padding
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    torch.testing.assert_close(importance_weights(log_rho, mask, mode="mask"), torch.zeros(2, 3))


def test_importance_weights_keep_the_dtype_of_log_rho():
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    for dtype in (torch.float32, torch.float64):
        w = importance_weights(torch.tensor([[0.0, LN2, 5.0]], dtype=dtype), mask)
        assert w.dtype == dtype
        torch.testing.assert_close(w, torch.tensor([[0.8, 1.2, 0.0]], dtype=dtype))   # 1, 1.5 over their mean 1.25


def test_rejection_mask_default_veto_is_1e_4():
    # rho = 5e-4 is out of the band [0.5, 1.5] but above the default veto 1e-4 (docs/method.md section 5): the
    # token leaves the mask, the response stays
    new_mask, stats = rejection_mask(torch.tensor([[1.0, 5e-4, 1.0]]).log(), torch.ones(1, 3))
    assert new_mask.tolist() == [[1.0, 0.0, 1.0]] and stats["vetoed"] == 0
    new_mask, stats = rejection_mask(torch.tensor([[1.0, 5e-5, 1.0]]).log(), torch.ones(1, 3))
    assert new_mask.tolist() == [[0.0, 0.0, 0.0]] and stats["vetoed"] == 1


def test_rejection_mask_veto_is_strict_and_the_mask_keeps_its_dtype():
    # rho = 1 exactly with veto 1.0: not below the veto, so the response stays
    mask = torch.tensor([[1.0, 1.0]])
    new_mask, stats = rejection_mask(torch.zeros(1, 2), mask, veto=1.0)
    assert new_mask.dtype == torch.float32 and new_mask.tolist() == [[1.0, 1.0]] and stats["vetoed"] == 0
    long_mask, _ = rejection_mask(torch.tensor([[0.0, 2.0]]), mask.long())
    assert long_mask.dtype == torch.long and long_mask.tolist() == [[1, 0]]    # e^2 leaves the band


def test_rejection_mask_geometric_mean_over_real_tokens_of_the_clamped_log_rho():
    # row 0: one real token, rho 1.1, outside [0.95, 1.05]; a mean over T = 2 slots would give sqrt(1.1) = 1.049, inside
    # row 1: log rho 30 and -20 clamp to 20 and -20: mean 0, rho 1, kept (unclamped: mean 5, rejected); veto off
    log_rho = torch.tensor([[math.log(1.1), 0.0], [30.0, -20.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    new_mask, stats = rejection_mask(log_rho, mask, veto=0.0, low=0.95, high=1.05, mode="geometric")
    assert new_mask.tolist() == [[0, 0], [1, 1]]
    assert stats == dict(vetoed=0, emptied=1, dropped_tokens=1, kept_tokens=2)


def test_downsample_random_keeps_m_distinct_rows_of_each_group():
    # 50 groups of 4, keep 3 at random: in each group 3 different rows of that group, sorted (drawing with
    # replacement repeats a row in some group), and over the groups every one of the 4 rows gets chosen
    idx = downsample(torch.zeros(200), 4, 3, rule="random", generator=torch.Generator().manual_seed(0)).view(50, 3)
    first = torch.arange(50)[:, None] * 4
    assert ((idx >= first) & (idx < first + 4)).all()
    assert (idx.diff(dim=-1) > 0).all()
    assert set((idx - first).flatten().tolist()) == {0, 1, 2, 3}


# ----------------------------------------------------------------------------- 8. mutation testing's survivors
# Each test below fails on a small change to correction.py that every test above let through (an off-by-default,
# a stat over the wrong tokens, a missing detach or clamp); the docstring of each names the change it catches.

def test_rejection_and_mismatch_default_band_is_0_5_to_1_5():
    # the tests above pin the default band only between rho 0.4 and 0.51 and between 1.49 and 1.6: a default of
    # low=0.45 or high=1.55 passed them. Here rho just inside (0.5, 1.5, exact in fp32) and just outside (0.49, 1.51)
    rho = torch.tensor([[0.5, 1.5, 0.49, 1.51, 0.45, 1.55, 1.0, 1.0]])
    new_mask, stats = rejection_mask(rho.log(), torch.ones(1, 8))
    assert new_mask.tolist() == [[1, 1, 0, 0, 0, 0, 1, 1]] and stats["dropped_tokens"] == 4
    # mismatch_stats's out_of_band uses the same band (a default low 0.6 or high 1.9 passed before): 0.52 and 1.48
    # inside, 0.48 and 1.52 outside (away from the edges, which log-then-exp may round across)
    rho = torch.tensor([[0.52, 1.48, 0.48, 1.52]])
    assert mismatch_stats(rho.log(), torch.zeros(1, 4), torch.ones(1, 4))["out_of_band"] == pytest.approx(0.5)


def test_stats_are_plain_python_numbers():
    # train.py json.dumps every stats dict: a 0-d tensor compares == to its number (so the by-hand tests pass on
    # `stats["tokens"] = real.sum()` or `rho_mean=rho.mean()`) and then fails json.dumps
    rho = torch.tensor([[1.0, 2.0, 0.8], [0.25, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    topk = torch.log(torch.full((2, 3, 2), 0.4))
    stats = mismatch_stats(rho.log(), torch.zeros(2, 3), mask, topk, topk)
    assert type(stats.pop("tokens")) is int and all(type(v) is float for v in stats.values()), stats
    logp, logp_old, adv, mask, weights = hand_loss_inputs()
    _, stats = policy_loss(logp, logp_old, adv, mask, weights, kl_coef=0.1, logp_ref=logp.detach())
    assert all(type(stats[key]) is int for key in ("tokens", "responses", "signal_tokens")), stats
    assert all(type(stats[key]) is float for key in ("clip_frac", "ratio_mean", "weight_mean", "kl")), stats
    _, stats = group_advantages(torch.tensor([0.0, 1.0, 1.0, 1.0]), 2)
    assert all(type(v) is int for v in stats.values()), stats


def test_policy_loss_stats_are_over_the_kept_tokens():
    # clip_frac and kl average over the tokens kept after rejection, as ratio_mean and weight_mean do (the by-hand
    # test keeps every token, where the kept and the sampled counts agree). Response 0's first token (r = 1.5,
    # clipped) rejected: of the 4 kept, only response 1's r = 0.5 (A = -1) is clipped: 1/4 (over the 5 sampled: 1/5)
    logp, logp_old, adv, mask, weights = hand_loss_inputs()
    kept = mask.clone()
    kept[0, 0] = 0
    logp_ref = logp.detach() + LN2                             # k3 = 1 - ln 2 on every token
    _, stats = policy_loss(logp, logp_old, adv, kept, weights, kl_coef=0.5, logp_ref=logp_ref, response_mask=mask)
    assert stats["clip_frac"] == pytest.approx(1 / 4) and stats["kl"] == pytest.approx(1 - LN2, rel=1e-5)


def test_policy_loss_sends_no_gradient_to_logp_old_or_logp_ref():
    # pi_old and pi_ref are fixed targets: a caller whose logp_old or logp_ref still carries a graph (scored with grad,
    # or pi_ref = pi_theta as in a first step) must not train through them. Dropping either .detach() passed before,
    # since every test above gave tensors without grad
    logp, logp_old, adv, mask, weights = hand_loss_inputs()
    logp_old = logp_old.clone().requires_grad_()
    logp_ref = (logp.detach() + 0.3).requires_grad_()
    loss, _ = policy_loss(logp, logp_old, adv, mask, weights, kl_coef=0.5, logp_ref=logp_ref)
    to_logp, to_old, to_ref = torch.autograd.grad(loss, [logp, logp_old, logp_ref], allow_unused=True)
    assert to_old is None and to_ref is None and to_logp.ne(0).any()


def test_policy_loss_kl_clamps_log_ref_at_20():
    # the k3 term's log(pi_ref / pi_theta) is clamped as log r is (docs/method.md section 1): a reference 1000 nats
    # away gives k3 = e^20 - 1 - 20 per token, finite, not e^1000 = inf (then an inf loss and a NaN step)
    logp = torch.full((1, 2), -1.0, requires_grad=True)
    logp_ref = torch.tensor([[999.0, -1001.0]])                # log ratio +1000 and -1000
    loss, stats = policy_loss(logp, logp.detach(), torch.zeros(1), torch.ones(1, 2), kl_coef=1.0, logp_ref=logp_ref)
    e20 = math.exp(20)
    expected = ((e20 - 1 - 20) + (1 / e20 - 1 + 20)) / 2       # seq-mean of the two k3 values
    assert loss.item() == pytest.approx(expected, rel=1e-5) and stats["kl"] == pytest.approx(expected, rel=1e-5)
    assert torch.isfinite(grad_of(loss, logp)).all()


def test_policy_loss_of_an_empty_batch_is_zero():
    # N = 0 responses (every group filtered out before the step): loss 0 with a zero gradient, not 0 / 0 = NaN
    logp = torch.zeros(0, 3, requires_grad=True)
    for agg in ("seq-mean", "token-mean"):
        stats = assert_zero_loss_and_gradient(logp, logp.detach(), torch.zeros(0), torch.zeros(0, 3), agg=agg)
        assert stats["tokens"] == 0 and stats["responses"] == 0


def test_dense_logprobs_passes_chunk_on(tiny_llama):
    # dense_logprobs(chunk=c) runs the output layer c positions at a time (its docstring; the memory bound): dropping
    # chunk on the way to response_logprobs gives the same numbers, so only the calls to the output layer tell
    rollouts, _ = hand_rollouts()                                                   # N = 3, T = 6
    calls = []
    hook = tiny_llama.lm_head.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[1]))
    try:
        dense_logprobs(tiny_llama, rollouts, batch_size=3, chunk=4)
        assert calls == [4, 2]
    finally:
        hook.remove()


def test_dense_logprobs_accepts_the_lowest_temperature(tiny_llama):
    # the sampler accepts temperature = MIN_TEMPERATURE (1e-6) exactly, so re-scoring must too, with finite log-probs
    # (a strict `MIN_TEMPERATURE < temperature` refused every rollout sampled there)
    rollouts, _ = hand_rollouts()
    logp = dense_logprobs(tiny_llama, rollouts, temperature=correction.MIN_TEMPERATURE)
    assert torch.isfinite(logp).all()


def test_response_logprobs_rejects_empty_or_miscounted_prompts_and_bad_chunks(tiny_llama):
    # an empty prompt put response token 0 at position P - 1 = -1, the last position of the row (garbage log-probs,
    # silently); a prompt count unlike N failed inside torch with a broadcasting RuntimeError; chunk=0 fell back to
    # the default (`chunk or ...`) instead of being refused, and -1 or 2.5 failed inside torch.split
    rollouts, _ = hand_rollouts()
    fields = rollouts.tokens, rollouts.mask, rollouts.logprobs, rollouts.topk_logprobs, rollouts.topk_ids
    for prompts in ([[1, 5, 7], [], [2, 4]], rollouts.prompts[:2], rollouts.prompts + [[1, 2]]):
        with pytest.raises(ValueError, match="need 3 non-empty prompts for 3 responses"):
            response_logprobs(tiny_llama, Rollouts(prompts, *fields))
    for chunk in (0, -1, 2.5):
        with pytest.raises(ValueError, match=rf"chunk must be a positive integer .* got {chunk}"):
            dense_logprobs(tiny_llama, rollouts, chunk=chunk)


def test_downsample_max_variance_ties_are_broken_the_same_on_every_device():
    # 64 rewards of 0 and 1, keep 16: the best subsets are 8 zeros and 8 ones, and many are tied. One stable sort
    # (ascending, ties by row) picks the 8 earliest 0s (the lowest) and the 8 latest 1s (the highest); an unstable
    # sort picks other rows of equal variance, which differ between CPU and GPU and between runs of a resumed job
    ties = np.random.default_rng(0).integers(0, 2, 64)
    zeros, ones = [i for i in range(64) if ties[i] == 0], [i for i in range(64) if ties[i] == 1]
    assert len(zeros) >= 8 and len(ones) >= 8
    expected = sorted(zeros[:8] + ones[-8:])
    assert downsample(torch.tensor(ties, dtype=torch.float64), 64, 16).tolist() == expected


def test_importance_weights_normalise_to_1_however_small_every_rho():
    # every rho = e^-20 (log rho at the clamp; veto off upstream): the weights' mean is 2.1e-9, still far above the
    # float's tiny (1.2e-38), so normalising gives 1 on every real token. A floor like 1e-8 or the float's eps in
    # place of tiny divided by the floor instead and gave 0.2 (or 1.7e-2): the gradient silently shrunk
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    for mode in ("truncate", "mask"):
        w = importance_weights(torch.full((2, 3), -20.0), mask, mode=mode)
        torch.testing.assert_close(w, mask, rtol=1e-6, atol=0)


def test_group_advantages_tell_float64_rewards_apart_at_1e_9():
    # 1 and 1 + 1e-9 are different float64 rewards (equal in float32): the group has a spread, so it is not a
    # zero-std group and its advantages are +-0.5e-9 / (std + 1e-4), std = 1e-9 / sqrt 2; comparing in float32
    # zeroed them
    rewards = torch.tensor([1.0, 1.0 + 1e-9], dtype=torch.float64)
    advantages, stats = group_advantages(rewards, 2)
    a = 0.5e-9 / ((rewards[1] - rewards[0]).item() / math.sqrt(2) + 1e-4)
    assert stats["zero_std_groups"] == 0 and advantages.tolist() == pytest.approx([-a, a], rel=1e-6)


# ----------------------------------------------------------------------------- 9. mutation testing's survivors, II
# Each test below fails on one small change to correction.py's checks or re-scoring that every test above let through.

def test_check_shapes_checks_every_tensor_after_the_first():
    # check_shapes compares each tensor with the first, not just the second: a mask of the wrong shape given third
    # (mismatch_stats, policy_loss) reached the indexing and failed there with an IndexError, or broadcast silently
    with pytest.raises(ValueError, match=r"mask has shape \(2, 4\), expected \(2, 3\) like logp_dense"):
        mismatch_stats(Z, Z, torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"c has shape \(3,\), expected \(2, 3\) like a"):
        correction.check_shapes(a=Z, b=Z, c=torch.zeros(3))
    # mismatch_stats names its own top-k arguments, not acceptance's topk_logp_a / topk_logp_b it passes them to
    with pytest.raises(ValueError, match=r"topk_sparse has shape \(2, 3, 5\), expected \(2, 3, 4\) like topk_dense"):
        mismatch_stats(Z, Z, Z, torch.zeros(2, 3, 4), torch.zeros(2, 3, 5))


def test_check_groups_refuses_a_float_group_size_and_names_the_first_bad_reward():
    # group_size 2.0 divides 4 rewards evenly (4 % 2.0 == 0.0) and then failed inside torch's view with a TypeError;
    # of two non-finite rewards the message names the first (row 1), not the last (row 2)
    with pytest.raises(ValueError, match="group_size must be a positive integer, got 2.0"):
        group_advantages(torch.zeros(4), 2.0)
    with pytest.raises(ValueError, match="rewards must be finite, got nan at row 1"):
        group_advantages(torch.tensor([0.0, math.nan, math.inf, 1.0]), 2)


def test_check_band_takes_low_0_and_refuses_a_negative_low():
    # 0 <= low: low = 0 is a proper band (no lower edge: every rho >= 0 is in it), a negative low is a typo. Only
    # low > high and low == high were refused before, so `0 < low` (refusing 0) and a dropped `0 <=` both passed
    rho = torch.tensor([[0.01, 1.0, 1.6]])
    new_mask, _ = rejection_mask(rho.log(), torch.ones(1, 3), veto=0.0, low=0.0, high=1.5)
    assert new_mask.tolist() == [[1, 1, 0]]
    assert mismatch_stats(rho.log(), torch.zeros(1, 3), torch.ones(1, 3), low=0.0)["out_of_band"] == pytest.approx(1 / 3)
    for call in (lambda: rejection_mask(Z, Z, low=-0.5, high=1.5), lambda: mismatch_stats(Z, Z, Z, low=-0.5)):
        with pytest.raises(ValueError, match=r"need 0 <= low < high for the rho band, got low=-0.5, high=1.5"):
            call()


def test_dense_logprobs_refuses_a_float_batch_size(tiny_llama):
    # batch_size 2.5 passed `< 1` and then failed inside range() with a TypeError, not the message batch_size 0 gets
    rollouts, _ = hand_rollouts()
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 2.5"):
        dense_logprobs(tiny_llama, rollouts, batch_size=2.5)


def test_response_logprobs_passes_model_kwargs_to_the_decoder(tiny_llama, monkeypatch):
    # distill.py's sparse forward passes its attention masks as **model_kwargs: dropping them on the way to the
    # decoder scores every token dense, silently (same shapes, plausible numbers). A recording decoder tells.
    rollouts, _ = hand_rollouts()
    decoder, seen = tiny_llama.get_decoder(), []

    def recording(**kwargs):
        seen.append(kwargs.get("marker"))
        return decoder(**{k: v for k, v in kwargs.items() if k != "marker"})
    monkeypatch.setattr(tiny_llama, "get_decoder", lambda: recording)
    with torch.no_grad():
        response_logprobs(tiny_llama, rollouts, marker="sparse")
    assert seen == ["sparse"]


def test_mismatch_stats_alpha_is_summed_in_float64():
    # alpha sums min(p_dense, p_sparse) over k = 64 ids: exponentiated and summed in fp32 (then cast), alpha_mean is
    # off by ~1e-7, the size of the tail statistic's margin at a p05 near 0.86 over millions of tokens. Reference:
    # a plain-Python loop over the same fp32 log-probs, in Python's float64
    g = torch.Generator().manual_seed(3)
    topk_dense = torch.log_softmax(torch.randn(2, 3, 64, generator=g), -1)
    topk_sparse = torch.log_softmax(torch.randn(2, 3, 64, generator=g), -1)
    alphas = [sum(min(math.exp(a), math.exp(b)) for a, b in zip(topk_dense[i, t].tolist(), topk_sparse[i, t].tolist()))
              for i in range(2) for t in range(3)]
    stats = mismatch_stats(Z, Z, torch.ones(2, 3), topk_dense, topk_sparse)
    assert stats["alpha_mean"] == pytest.approx(sum(alphas) / 6, rel=1e-13, abs=0)
