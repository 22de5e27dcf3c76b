"""schedule.py: acceptance, tail per bin, calibration, bad input (the cost model: test_cost; the controller:
test_controller).

Each test compares with an independent computation (numpy, a hand calculation, a brute-force sum),
so it can fail."""
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import cost
import distill
import models
import schedule as S
import tasks
from kvcache import DENSE, KVCache, SparseConfig
from reference import tiny_model
from sampler import generate
from schedule import (THRESHOLD, Schedule, acceptance, bin_metrics, bins_for, calibrate, compressed_bins,
                      constant, measure, piecewise, tail_by_bin, token_contexts)

PROMPTS = [[1 + (7 * i + j) % 60 for j in range(6 + 3 * i)] for i in range(6)]   # lengths 6..21
SPARSE = SparseConfig("snapkv", budget=6, interval=2, window=2, sink=2, kernel=3)


# 1. acceptance

def test_acceptance_is_one_minus_tv_by_hand_and_a_lower_bound_with_top_k():
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.3, 0.5])
    assert acceptance(p.log(), q.log()).item() == pytest.approx(1 - 0.5 * (0.3 + 0.0 + 0.3))
    assert acceptance(p.log(), p.log()).item() == pytest.approx(1.0)
    g = torch.Generator().manual_seed(0)
    logp, logq = (torch.randn(100, 50, generator=g) * 2).log_softmax(-1), torch.randn(100, 50, generator=g).log_softmax(-1)
    exact = 1 - 0.5 * (logp.exp() - logq.exp()).abs().sum(-1)
    assert torch.allclose(acceptance(logp, logq), exact, atol=1e-6)
    ids = logq.topk(10, dim=-1).indices                                 # the sampler's top-10
    bound = acceptance(logp.gather(-1, ids), logq.gather(-1, ids))
    assert (bound <= exact + 1e-6).all() and (bound < exact - 1e-3).any()


# 2. tail per bin

def test_tail_by_bin_equals_numpy_quantile_per_bin():
    rng = np.random.default_rng(0)
    alpha = rng.uniform(0.5, 1.0, size=(7, 30))
    positions = rng.integers(-1, 90, size=(7, 30))
    tails, counts = tail_by_bin(torch.tensor(alpha), torch.tensor(positions), bin_size=16, q=0.05)
    for i in range(90 // 16 + 1):
        inside = (positions >= 0) & (positions // 16 == i)
        assert counts[i] == inside.sum()
        assert tails[i].item() == pytest.approx(np.quantile(alpha[inside], 0.05))
    empty, _ = tail_by_bin(torch.ones(3), torch.tensor([0, 40, -1]), bin_size=16)
    assert empty[1].isnan() and empty[0] == empty[2] == 1.0


def test_tail_by_bin_of_a_bin_with_more_than_2_24_tokens():
    # torch.quantile refuses more than 2^24 values: a bin of 2^24 + 1 tokens raised a RuntimeError. The first 10 %
    # have alpha 0.25, the rest 1, so the 5th percentile lies inside the first 10 % (3-5 s on 2 shared cores)
    n = 2 ** 24 + 1
    alpha = torch.where(torch.arange(n) < n // 10, 0.25, 1.0)
    tails, counts = tail_by_bin(alpha, torch.zeros(n, dtype=torch.long), bin_size=16)
    assert counts.tolist() == [n] and tails.tolist() == [0.25]


# 3. calibration

def budgets_in_order(budgets):
    return all((a or DENSE) <= (b or DENSE) for a, b in zip(budgets, budgets[1:]))


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def test_calibrate_picks_the_smallest_passing_budget_and_its_tails_hold(model):
    kw = dict(candidates=[6, 10, 16], bin_size=8, sparse=SPARSE, max_new_tokens=20)
    schedule, rows = calibrate(model, PROMPTS, threshold=0.97, **kw)
    # measured on this model: at a constant budget the tail falls with the context, so the budget grows
    assert budgets_in_order(schedule.budgets) and schedule.budgets[0] < schedule.budgets[-1]
    assert [r["budget"] for r in rows] == list(schedule.budgets)
    tails, counts = tail_by_bin(*measure(model, PROMPTS, SparseConfig(**{**vars(SPARSE), "schedule": schedule}), 20),
                                bin_size=8)
    assert all(t >= 0.97 for t, c in zip(tails.tolist(), counts.tolist()) if c > 0)   # re-measured
    assert set(calibrate(model, PROMPTS, threshold=0.0, **kw)[0].budgets) == {6}
    assert set(calibrate(model, PROMPTS, threshold=1.0, **kw)[0].budgets) == {None}  # dense: evicts nothing


def test_measure_samples_with_the_adapter_and_rescores_densely_at_the_sampling_temperature():
    # A full cache at temperature 0.7: the sampler and the dense re-scoring are one distribution, alpha = 1 (the
    # vocabulary, 64, is the top-k: exact). With a DistillSparse adapter the sampler is theta + phi and the dense
    # side theta alone: alpha = sum_v min(p_theta, p_theta+phi) at 0.7, against one plain forward pass of each
    model, prompts = tiny_model("llama"), PROMPTS[:3]
    alpha, contexts = measure(model, prompts, SparseConfig("full"), 8, temperature=0.7)
    assert torch.allclose(alpha[contexts >= 0].double(), torch.ones(()).double(), atol=1e-5)
    lora = distill.LoRA(model, rank=4)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for B in lora.B.values():
            B.copy_(torch.randn(B.shape, generator=g) * 0.05)
    alpha, contexts = measure(model, prompts, SparseConfig("full"), 8, temperature=0.7, adapter=lora)
    with lora.on():
        out = generate(model, prompts, SparseConfig("full"), 8, 0.7)          # measure's sampler, seed 0
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt + out.tokens[i].tolist()])
        with torch.no_grad():
            dense = torch.softmax(model(ids).logits[0, len(prompt) - 1:-1] / 0.7, -1)
            with lora.on():
                sparse = torch.softmax(model(ids).logits[0, len(prompt) - 1:-1] / 0.7, -1)
        expected = torch.minimum(dense, sparse).sum(-1).double()
        assert torch.allclose(alpha[i][contexts[i] >= 0].double(), expected[out.mask[i] > 0], atol=1e-5)
    assert alpha[contexts >= 0].mean() < 0.99                           # the adapter really moved the sampler


def simulated_streaming(monkeypatch, D):
    """Put a stand-in for `measure` in place: one response sampled at the contexts of D (a dict context -> how
    far back the token at that context looks) through a cache that keeps the newest b(c) tokens at context c and
    never gets an evicted one back. A token's acceptance is THRESHOLD if the token D(c) back is still cached, else
    0.5. Returns the list of the schedules (budgets per bin, None: dense) it is given, filled as calibrate runs."""
    tried = []

    def fake_measure(model, prompts, sparse, max_new_tokens, **sampling):
        budget = (lambda c: sparse.budget) if sparse.schedule is None else sparse.schedule
        if sparse.schedule is not None:
            tried.append([None if budget(b) >= DENSE else budget(b) for b in sparse.schedule.bins])
        kept = [all(c2 - budget(c2) <= c - D[c] for c2 in range(c - D[c] + 1, c + 1)) for c in D]
        return torch.tensor([[THRESHOLD if k else 0.5 for k in kept]], dtype=torch.float64), torch.tensor([list(D)])

    monkeypatch.setattr(S, "measure", fake_measure)
    return tried


def test_calibrate_on_a_simulated_streaming_cache_by_hand(monkeypatch):
    # `simulated_streaming` [1, 16]: one response sampled at contexts 4..19 (bins of 4: bin 0 holds no token). The
    # token at context c needs the one D(c) back: D = 4 at c = 8 (bin 2's first), 6 at c = 12 (bin 3's first), else
    # 2. Its acceptance is exactly the threshold, 0.86, if that token is still cached (the bin holds), else 0.5.
    D = {c: {8: 4, 12: 6}.get(c, 2) for c in range(4, 20)}
    tried = simulated_streaming(monkeypatch, D)                         # the schedules measured, in order
    sparse = SparseConfig("streaming", budget=2, interval=1, window=1, sink=0)   # interval 1: never above budget
    schedule, rows = calibrate(None, None, candidates=[8, 2, 4, 2], bin_size=4, sparse=sparse)   # any order
    # at a constant budget b the token D back is kept iff b >= D: bin 1 holds from 2, bin 2 from 4, bin 3 from 8,
    # bin 4 from 2 (q 0.05 of [0.5, 0.86, 0.86, 0.86] = 0.554); bin 0 has no token (nan) and holds with anything
    assert [[round(t, 3) if t == t else "nan" for t in r["profile"]] for r in rows] == [
        ["nan"] * 3, [0.86] * 3, [0.554, 0.86, 0.86], [0.554, 0.554, 0.86], [0.86] * 3]
    # -> [2, 2, 4, 8, 2], made non-decreasing. Under that schedule bin 2's first token (c = 8, needs position 4)
    # was evicted at c = 7 by bin 1's 2, bin 3's (c = 12, needs 6) at c = 11 by bin 2's 4. The earliest failing
    # bin moves first, to its next candidate: bin 2 -> 8 (bin 3 now holds). Bin 2 still fails, and at 8 the cache
    # compresses nothing in it (it holds 3-6 tokens at contexts 8-11): what bin 2 misses, bin 1 dropped, so bin 1
    # -> 4, and every bin holds, at exactly 0.86 (>=). (Counting the context, 8 + 1 <= 11, blamed bin 2 again,
    # which went dense, and bins 3 and 4 with it: [2, 4, None, None, None].)
    assert tried == [[2, 2, 4, 8, 8], [2, 2, 8, 8, 8], [2, 4, 8, 8, 8]]
    assert schedule == piecewise([0, 4, 8, 12, 16], [2, 4, 8, 8, 8])
    assert [r["budget"] for r in rows] == [2, 4, 8, 8, 8] and [r["tokens"] for r in rows] == [0, 4, 4, 4, 4]
    assert math.isnan(rows[0]["tail"]) and [r["tail"] for r in rows[1:]] == [THRESHOLD] * 4
    # With a candidate of 16, bin 3 holds at 16 -> [2, 2, 4, 16, 16]; bin 2 fails, compresses at 4 (contexts
    # 10-11), -> 16; it still fails, but at 16 the cache compresses nothing in it: bin 1 moves, to 4
    tried.clear()
    schedule, _ = calibrate(None, None, candidates=[2, 4, 16], bin_size=4, sparse=sparse)
    assert tried == [[2, 2, 4, 16, 16], [2, 2, 16, 16, 16], [2, 4, 16, 16, 16]]
    assert schedule == piecewise([0, 4, 8, 12, 16], [2, 4, 16, 16, 16])


def test_calibrate_keeps_every_bin_that_some_candidate_reached(monkeypatch):
    """Candidates end their responses at different lengths (EOS comes when it comes). A stand-in for `measure`,
    every alpha 1.0: at constant budget 2 the response is sampled at contexts 4-7 (bins of 4: bins 0-1), at 4 and
    under a schedule at 4-11 (bins 0-2). By hand: three bins, bin 2 reached only at 4; bin 2 holds at 2, where it
    has no token (nan: holds with anything), so the schedule is 2 everywhere, and under it every bin holds. Each
    row names its bin [i * 4, (i + 1) * 4), the printed table's 0-3, 4-7, 8-11."""
    def fake_measure(model, prompts, sparse, max_new_tokens, **sampling):
        contexts = range(4, 8) if sparse.schedule is None and sparse.budget == 2 else range(4, 12)
        return torch.ones(1, len(contexts), dtype=torch.float64), torch.tensor([list(contexts)])

    monkeypatch.setattr(S, "measure", fake_measure)
    sparse = SparseConfig("streaming", budget=2, interval=1, window=1, sink=0)
    schedule, rows = calibrate(None, None, candidates=[2, 4], bin_size=4, sparse=sparse)
    assert schedule == piecewise([0, 4, 8], [2, 2, 2])
    assert [r["bins"] for r in rows] == [(0, 4), (4, 8), (8, 12)] and [r["tokens"] for r in rows] == [0, 4, 4]
    assert [["nan" if t != t else t for t in r["profile"]] for r in rows] == [["nan", "nan"], [1.0, 1.0], ["nan", 1.0]]


def test_calibrate_for_block_topk_blames_the_failing_bin_itself(monkeypatch):
    # Block top-k, pages of 16, interval 128, bins of 128, contexts 0-255. A stand-in for `measure`: bin 0 always
    # holds; bin 1 holds if its budget is >= 256, or >= 192 while bin 0's is >= 160 (earlier sparse steps shape
    # the states later tokens attend to). Held constant, 128 fails bin 1 and 192 holds, so calibrate tries
    # [128, 192] and bin 1 fails. It attends 192 // 16 + 3 = 15 of its 16 pages: the controller's page rule
    # raises bin 1 itself, to 256, and every bin holds. (The eviction rule would find no bin that evicts,
    # 128 + 128 > 127 and 192 + 128 > 255, and stop with bin 1 failing.)
    tried = []

    def fake_measure(model, prompts, sparse, max_new_tokens, **sampling):
        budget = (lambda c: sparse.budget) if sparse.schedule is None else sparse.schedule
        if sparse.schedule is not None:
            tried.append([budget(b) for b in sparse.schedule.bins])
        holds = budget(128) >= 256 or (budget(128) >= 192 and budget(0) >= 160)
        contexts = torch.arange(256)
        return torch.where(contexts < 128, 1.0, 1.0 if holds else 0.5).double()[None], contexts[None]

    monkeypatch.setattr(S, "measure", fake_measure)
    sparse = SparseConfig("blocktopk", budget=128, interval=128, page_size=16)
    schedule, rows = calibrate(None, None, candidates=[128, 192, 256], bin_size=128, sparse=sparse)
    assert tried == [[128, 192], [128, 256]]
    assert schedule == piecewise([0, 128], [128, 256]) and [r["tail"] for r in rows] == [1.0, 1.0]


def test_calibrate_raises_bin_0_when_it_is_to_blame_and_only_if_its_cache_reaches_budget_plus_interval(monkeypatch):
    # Pins the blame in calibrate: bin 0 may be the culprit (a `- {None, 0}` would never raise it), and the
    # sampler's interval decides whether a bin evicts (interval 1 in its place would blame bin 0 at interval 2 too).
    # Stand-in `measure` as above, bins of 4, contexts 2-7: the token at 4 needs position 0, evicted at context 3
    # by a budget of 2. Held constant, 2 fails bin 1 (q 0.05 of [0.5, 0.86, 0.86, 0.86]) and 8 holds: -> [2, 8].
    D = {c: {4: 4}.get(c, 2) for c in range(2, 8)}

    def fake_measure(model, prompts, sparse, max_new_tokens, **sampling):
        budget = (lambda c: sparse.budget) if sparse.schedule is None else sparse.schedule
        kept = [all(c2 - budget(c2) <= c - D[c] for c2 in range(c - D[c] + 1, c + 1)) for c in D]
        return torch.tensor([[THRESHOLD if k else 0.5 for k in kept]], dtype=torch.float64), torch.tensor([list(D)])

    monkeypatch.setattr(S, "measure", fake_measure)
    run = lambda interval: calibrate(None, None, candidates=[2, 8], bin_size=4, max_new_tokens=6,
                                     sparse=SparseConfig("streaming", budget=2, interval=interval, window=1, sink=0))
    # interval 1: bin 1 (8 + 1 > 7) evicts nothing; bin 0 (2 + 1 <= 3) does: it is raised to 8, and both hold
    assert run(1)[0] == piecewise([0, 4], [8, 8])
    # interval 2: bin 0's cache (the 2-token prompt, then 3 at context 3) never reaches 2 + 2, so no bin is to
    # blame: calibrate stops, bin 1 below
    schedule, rows = run(2)
    assert schedule == piecewise([0, 4], [2, 8]) and rows[1]["tail"] < THRESHOLD


@pytest.mark.parametrize("candidates, message", [
    ([], "candidates must name at least one budget, got \\[\\]"),   # was: max() arg is an empty sequence
    ([16, 2 ** 41], "budget must be at most 2\\*\\*40"),
    ([16, 16.5], "budget must be a positive integer, got 16.5")])
def test_calibrate_refuses_bad_candidates_before_sampling_any(monkeypatch, candidates, message):
    # a bad candidate was found when its turn came, after the good ones below it had each sampled every prompt
    monkeypatch.setattr(S, "measure", lambda *a, **k: pytest.fail("sampled"))
    with pytest.raises(ValueError, match=message):
        calibrate(None, PROMPTS, candidates, sparse=SparseConfig("snapkv"))


def test_a_schedule_sets_the_budget_of_each_compression(model):
    schedule = piecewise([0, 24], [6, 12])
    out = generate(model, PROMPTS[-2:], SparseConfig(**{**vars(SPARSE), "schedule": schedule}),
                   max_new_tokens=20, record=True)
    kept = [(s[:, 0] >= 0).sum(-1) for s in out.kept[0]]                # [B] valid kept tokens per step
    contexts = []
    for step in range(1, len(kept) - 1):
        for b, prompt in enumerate(PROMPTS[-2:]):
            if kept[step + 1][b] < kept[step][b]:                         # compressed at step + 1
                assert kept[step + 1][b] == schedule(len(prompt) + step + 1)
                contexts.append(len(prompt) + step + 1)
    # compressions in both bins, at 6 and at 12: else the loop checks nothing (a scheduled cache that never
    # evicted passed it). Mutant caught: a scheduled cache treated as one that never evicts (KVCache.start_step's
    # `evicts` and KVCache.capacity as for full)
    assert contexts and min(contexts) < 24 <= max(contexts)
    assert Schedule((0, 24), (6, None))(torch.tensor([3, 30])).tolist() == [6, DENSE]


# 4. what blame reads: the bins where the cache compressed (the controller's moves: test_controller.py)

@pytest.mark.parametrize("interval", [1, 3])
def test_compressed_bins_replays_the_caches_compressions(model, monkeypatch, interval):
    # the bins where the real cache compressed some row, recorded at each decode step of `generate`, against the
    # replay from the contexts alone. Bins of 8; budget 8, then 24 from context 24: prompts of 6-21 tokens and 9 new
    # reach contexts 29, but after the earlier compressions a row holds 8-15 tokens, so bin 3 compresses nothing
    schedule, bin_size, seen = piecewise([0, 8, 16, 24], [8, 8, 8, 24]), 8, set()
    start_step = KVCache.start_step

    def recording(cache, positions):
        start_step(cache, positions)
        seen.update((cache.context[cache.due] // bin_size).tolist())

    monkeypatch.setattr(KVCache, "start_step", recording)
    out = generate(model, PROMPTS, SparseConfig(**{**vars(SPARSE), "interval": interval, "schedule": schedule}), 9)
    assert compressed_bins(token_contexts(out), schedule, bin_size, interval) == sorted(seen) == [1, 2]


def test_by_bin_and_compressed_bins_against_a_token_by_token_replay():
    # random batches (rows of prompts 1-40 tokens, responses cut short, bins of 1-16, interval 1-7, a dense last bin
    # now and then) against plain loops: each token into its bin (past the last: the last), numpy's quantile, and
    # each row held token by token, compressed to schedule(c) once it holds schedule(c) + interval
    rng = np.random.default_rng(0)
    for _ in range(200):
        bin_size, n, interval, q = int(rng.choice([1, 4, 16])), int(rng.integers(1, 6)), int(rng.integers(1, 8)), 0.3
        budgets = sorted(int(b) for b in rng.integers(1, 30, n))
        budgets[-1] = None if rng.random() < 0.2 else budgets[-1]
        schedule = piecewise([i * bin_size for i in range(n)], budgets)
        T = int(rng.integers(1, 30))
        rows = [(int(rng.integers(1, 40)), int(rng.integers(1, T + 1))) for _ in range(int(rng.integers(1, 5)))]
        positions = torch.tensor([[p + t if t < length else -1 for t in range(T)] for p, length in rows])
        alpha = torch.tensor(rng.uniform(0, 1, positions.shape))
        tokens, longest, hit = [[] for _ in range(n)], [-1] * n, set()
        for a, c in zip(alpha.flatten().tolist(), positions.flatten().tolist()):
            if c >= 0:
                i = min(c // bin_size, n - 1)
                tokens[i].append(a)
                longest[i] = max(longest[i], c)
        for p, length in rows:
            held = p
            for c in range(p + 1, p + length):
                held += 1
                if held >= schedule(c) + interval:
                    held = schedule(c)
                    hit.add(min(c // bin_size, n - 1))
        tails, counts, most, compressed = S.by_bin(alpha, positions, schedule, bin_size, interval, q)
        assert counts.tolist() == [len(t) for t in tokens] and most.tolist() == longest
        assert compressed == compressed_bins(positions, schedule, bin_size, interval) == sorted(hit)
        expected = [np.quantile(t, q) if t else float("nan") for t in tokens]
        assert np.allclose(tails.numpy(), expected, equal_nan=True, rtol=0, atol=1e-12)


def test_calibrate_raises_the_earliest_blamed_bin_first(monkeypatch):
    # `simulated_streaming` (bins of 4, contexts 4-19, each token needs the one D(c) back, alpha 0.86 if kept,
    # else 0.5), with D = 6 at c = 9 (bin 2) and 8 at c = 12 (bin 3).
    # Held constant, bins 2 and 3 need 8, the rest 2: -> [2, 2, 8, 8, 8]. Under it both fail, for positions 3 and
    # 4 evicted at contexts 5-7 by bin 1's 2; bin 2 compresses nothing (it holds 3-6 tokens), so it blames bin 1,
    # bin 3 compresses (at 13) and blames itself. The earliest blamed bin moves: bin 1 -> 4, and both hold.
    # Raising bin 3 first would make it (and bin 4) dense for nothing: [2, 4, 8, None, None].
    D = {c: {9: 6, 12: 8}.get(c, 2) for c in range(4, 20)}
    tried = simulated_streaming(monkeypatch, D)
    sparse = SparseConfig("streaming", budget=2, interval=1, window=1, sink=0)
    schedule, rows = calibrate(None, None, candidates=[2, 4, 8], bin_size=4, sparse=sparse)
    assert tried == [[2, 2, 8, 8, 8], [2, 4, 8, 8, 8]]
    assert schedule == piecewise([0, 4, 8, 12, 16], [2, 4, 8, 8, 8])
    assert [r["tail"] for r in rows[1:]] == [THRESHOLD] * 4


def test_bin_metrics_by_hand():
    alpha = torch.tensor([[1.0, 0.5, 0.25, 0.0], [1.0, 1.0, 0.0, 0.0]])
    contexts = torch.tensor([[3, 4, 20, -1], [5, 6, 7, -1]])            # -1: not a response token
    m = bin_metrics(alpha, contexts, 8, piecewise([0, 4, 16], [6, 10, None]))
    assert m["tokens_by_bin"] == [5, 0, 1] and m["alpha_p05_by_bin"][1] is None
    assert m["alpha_p05_by_bin"][0] == pytest.approx(np.quantile([1.0, 0.5, 1.0, 1.0, 0.0], 0.05))
    assert m["budget_by_bin"] == [10, 10, None]                          # the largest budget in each bin; None: dense
    assert bin_metrics(alpha, contexts, 8, None)["budget_by_bin"] == [None, None, None]
    assert bin_metrics(alpha, contexts, 8, constant(24))["budget_by_bin"] == [24, 24, 24]


def test_token_contexts_and_scaled_schedules():
    rollouts = generate(tiny_model("llama"), [[1, 2, 3], [4, 5]], SPARSE, max_new_tokens=3, eos_token_id=None)
    rollouts.mask = rollouts.mask.clone()
    rollouts.mask[1, 2] = 0                                             # as if row 1 had ended
    assert token_contexts(rollouts).tolist() == [[3, 4, 5], [2, 3, -1]]
    assert piecewise([0, 8], [6, None]).scaled(2.5) == piecewise([0, 20], [15, None])
    assert piecewise([0, 100], [4, 60]).scaled(0.1) == piecewise([0, 10], [1, 6])  # 0.4 tokens: kept at 1
    assert piecewise([0, 10], [7, 9]).scaled(1.7) == piecewise([0, 17], [12, 15])  # 11.9 and 15.3: the nearest
    assert piecewise([0, 2], [8, 2 ** 40]).scaled(4) == piecewise([0, 8], [32, 2 ** 40])   # dense stays dense
    # bin starts are rounded too, not cut: 3 * 1.9 = 5.7 starts at 6 (int would give 5); 7.6 and 17.1 -> 8, 17
    assert piecewise([0, 3], [4, 9]).scaled(1.9) == piecewise([0, 6], [8, 17])


def test_bins_for_covers_every_context_a_response_token_is_sampled_at_and_no_more():
    # brute force: a response token is sampled at contexts prompt .. prompt + max_new_tokens - 1; one bin per
    # bin_size up to the last of them, as many as tail_by_bin makes of those contexts
    for prompt in (1, 15, 16, 17, 31):
        for new in (1, 16, 17):
            contexts = torch.arange(prompt, prompt + new)
            made = len(tail_by_bin(torch.ones(new), contexts, 16)[0])
            assert bins_for(prompt, new, 16) == made == max(contexts.tolist()) // 16 + 1


# 5. bad input

@pytest.mark.parametrize("make, message", [
    (lambda: piecewise([0, 16, 16], [8, 8, 8]), "bins must be strictly increasing"),
    (lambda: piecewise([4, 16], [8, 8]), "bins must be integers starting at 0"),
    (lambda: piecewise([0, 16], [8]), "need one budget per bin"),
    (lambda: piecewise([0], [0]), "budgets must be positive integers or None"),
    (lambda: piecewise([0, 16], [8, 2 ** 64]), "budgets must be .*at most 2\\*\\*40, got \\[8, 18446744073709551616\\]"),
    (lambda: piecewise([0, 16], [True, 8]), "budgets must be positive integers"),   # a JSON true was budget 1
    (lambda: piecewise([0, 2 ** 64], [8, 8]), "bins must be integers starting at 0, up to 2\\*\\*40"),
    (lambda: SparseConfig("snapkv", window=4, sink=2, schedule=piecewise([0, 16], [8, 5])),
     "budget=5 must be >= window \\+ sink = 4 \\+ 2"),
    (lambda: calibrate(None, PROMPTS, [8], threshold=-0.1), "threshold must lie in \\[0, 1\\], got -0.1"),
    (lambda: tail_by_bin(torch.ones(2), torch.zeros(2, dtype=torch.long), 0), "bin_size must be a positive"),
    (lambda: calibrate(None, PROMPTS, [8], bin_size=0), "bin_size must be a positive integer, got 0"),   # before
    (lambda: calibrate(None, PROMPTS, [8], q=5), "q must lie in \\[0, 1\\], got 5"),         # the model is used
    # check_bins' upper bound and integer check (a `threshold < 0` check, or `bin_size < 1` alone, passed both)
    (lambda: calibrate(None, PROMPTS, [8], threshold=1.5), "threshold must lie in \\[0, 1\\], got 1.5"),
    (lambda: tail_by_bin(torch.ones(2), torch.zeros(2, dtype=torch.long), 1.5),
     "bin_size must be a positive integer, got 1.5"),
])
def test_bad_input_is_a_clear_error(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_schedule_files_round_trip_and_bad_files_are_named(tmp_path):
    schedule = piecewise([0, 16, 48], [8, 12, None])
    schedule.save(tmp_path / "s.json")
    assert Schedule.load(tmp_path / "s.json") == schedule
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "keys.json").write_text('{"bins": [0]}')
    for name in ("bad.json", "keys.json", "missing.json"):
        with pytest.raises(ValueError, match=f"cannot read a schedule from .*{name}"):
            Schedule.load(tmp_path / name)
    with pytest.raises(ValueError, match="no key 'budgets'"):
        Schedule.load(tmp_path / "keys.json")
    (tmp_path / "ints.json").write_text('{"bins": 0, "budgets": 0}')   # a TypeError inside, named as the rest
    with pytest.raises(ValueError, match="cannot read a schedule from .*ints.json: 'int' object is not iterable"):
        Schedule.load(tmp_path / "ints.json")
    (tmp_path / "list.json").write_text("[0, 8]")                       # JSON, but no object: said so
    with pytest.raises(ValueError, match='list.json: it holds a list, not {"bins": \\[...\\], "budgets": \\[...\\]}$'):
        Schedule.load(tmp_path / "list.json")


def toy_warm_up(folder):
    """A random toy model saved as train.py saves its warm-up: weights, tokenizer, warmup.json (pick, 3-4 digits)."""
    from models import toy_model
    from tasks import char_tokenizer
    tok = char_tokenizer()
    toy_model(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    (Path(folder) / "warmup.json").write_text(json.dumps(dict(task="pick", digits=[3, 4])))


def test_calibrate_command_line_takes_device_and_dtype_and_its_schedule_feeds_speedup(tmp_path, capsys, monkeypatch):
    # as train.py: --device and --dtype (bfloat16 under autocast); a random toy model holds no budget, so every
    # bin ends dense or at a candidate, and the schedule file reads back
    # Pins what `set(budgets) <= {8, 12, None}` let through: every sampling and re-scoring (`measure`, read as it
    # runs) is on the CPU under bf16 autocast, with the warm-up task's cache settings (pick: TOY's interval 4,
    # window 4, sink 2) and bins of its 16 tokens, as many as cover the longest prompt + 12 new tokens
    # (`bins_for`, the prompts' lengths by brute force); the printed table's chosen column is the file's budgets.
    # Mutants caught: print_calibration's autocast given "float32" (the flag dropped); calibrate handed bin_size 8
    seen = []
    real = S.measure

    def watched(model, prompts, sparse, *a, **k):
        seen.append((torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"), model.device.type,
                     (sparse.policy, sparse.interval, sparse.window, sparse.sink)))
        return real(model, prompts, sparse, *a, **k)
    monkeypatch.setattr(S, "measure", watched)
    rows, calibrate_ = [], S.calibrate
    monkeypatch.setattr(S, "calibrate", lambda *a, **k: rows.append(calibrate_(*a, **k)) or rows[-1])
    toy_warm_up(tmp_path / "m")
    S.main(["--calibrate", "--model", str(tmp_path / "m"), "--prompts", "4", "--candidates", "8,12",
                   "--device", "cpu", "--dtype", "bfloat16", "--out", str(tmp_path / "s.json"),
                   "--speedup", str(tmp_path / "s.json")])          # the file it writes: the speedup of that schedule
    written = Schedule.load(tmp_path / "s.json")
    assert set(written.budgets) <= {8, 12, None}
    out = capsys.readouterr().out
    assert "wrote" in out and f"as calibrated: {list(written.budgets)} from {list(written.bins)}" in out
    assert len(seen) >= 3 and set(seen) == {(torch.bfloat16, "cpu", ("snapkv", 4, 4, 2))}   # 2 candidates + 1 schedule
    longest = max(len(tasks.encode_prompt(tasks.char_tokenizer(), e["prompt"]))
                  for e in tasks.make_examples("pick", 4, 0, 3, 4))
    assert written.bins == tuple(range(0, 16 * bins_for(longest, 12, 16), 16))
    chosen = [row.split("|")[4].strip() for row in out.splitlines() if re.match(r"\| \d+-\d+ \|", row)]
    assert chosen == ["dense" if b is None else str(b) for b in written.budgets]
    # the line under the table, from calibrate's rows by hand: the smallest candidate whose profile holds 0.86 in
    # every bin (an empty bin, nan, holds). Mutant caught: the largest such candidate printed (holds[-1])
    holding = [c for k, c in enumerate((8, 12)) if all(not r["profile"][k] < THRESHOLD for r in rows[0][1])]
    assert holding and f"the smallest constant budget holding {THRESHOLD} in every bin: {holding[0]}" in out


def test_calibration_refuses_a_response_past_the_models_positions_before_sampling(tmp_path, capsys, monkeypatch):
    # pick's prompts with 3-4 digits take at most 19 of the toy's 128 positions: 200 new tokens cannot fit
    toy_warm_up(tmp_path)
    monkeypatch.setattr(S, "calibrate", lambda *a, **k: pytest.fail("calibrated past the positions"))
    with pytest.raises(SystemExit):
        S.main(["--calibrate", "--model", str(tmp_path), "--max-new-tokens", "200", "--out", str(tmp_path / "s.json")])
    assert re.search("max_new_tokens \\(--max-new-tokens\\) 200: the longest prompt \\(\\d+ tokens\\) plus the "
                     "response must fit the model's 128 positions", capsys.readouterr().err)


def test_calibration_checks_the_positions_against_its_longest_prompt(tmp_path, capsys, monkeypatch):
    # Pins print_calibration's check on the longest prompt it samples (the shortest would let a response run
    # past the toy's 128 positions): with the longest found by brute force over those prompts, 129 - longest
    # new tokens are refused, 128 - longest reach calibrate
    import tasks
    from tasks import char_tokenizer
    toy_warm_up(tmp_path)
    tok = char_tokenizer()
    longest = max(len(tasks.encode_prompt(tok, e["prompt"])) for e in tasks.make_examples("pick", 8, 0, 3, 4))
    argv = ["--calibrate", "--model", str(tmp_path), "--prompts", "8", "--out", str(tmp_path / "s.json")]
    monkeypatch.setattr(S, "calibrate", lambda *a, **k: pytest.fail("calibrated"))
    with pytest.raises(SystemExit):
        S.main(argv + ["--max-new-tokens", str(129 - longest)])
    assert f"the longest prompt ({longest} tokens)" in capsys.readouterr().err
    with pytest.raises(pytest.fail.Exception, match="calibrated"):      # past the check, at calibrate
        S.main(argv + ["--max-new-tokens", str(128 - longest)])


def test_calibration_refuses_candidates_that_never_evict_before_sampling(tmp_path, capsys, monkeypatch):
    # --candidates 100,200 on the toy (prompts of at most `longest` tokens, 12 new) "held" 1.00 in every bin and
    # wrote a schedule of 100: a dense run under a budget's name. By brute force over the prompts, the longest row
    # holds row = longest + 11 tokens at its last step; snapkv (interval 4) compresses once a row holds budget + 4,
    # block top-k (pages of 4) skips a page once budget // 4 + 3 reserved pages < the row's pages.
    toy_warm_up(tmp_path)
    longest = max(len(tasks.encode_prompt(tasks.char_tokenizer(), e["prompt"]))
                  for e in tasks.make_examples("pick", 8, 0, 3, 4))
    row, pages = longest + 11, (longest + 10) // 4 + 1
    argv = ["--calibrate", "--model", str(tmp_path), "--prompts", "8", "--out", str(tmp_path / "s.json")]
    monkeypatch.setattr(S, "calibrate", lambda *a, **k: pytest.fail("calibrated"))
    whence = f"the longest rollout holds at most {row}( tokens)? \\(prompt {longest} \\+ --max-new-tokens 12 - 1\\)"
    for flags, message in [
            ([f"{row},{row + 8}"],
             f"--candidates {row}: {whence}, so snapkv would never evict: give a budget below {row}$"),
            ([f"{row - 3}"],
             f"--interval 4: .* = {row + 1} tokens, and {whence}, so budget {row - 3} would never evict: give "
             "--interval at most 3$"),
            ([f"{4 * pages - 12}", "--policy", "blocktopk"],
             f"--candidates {4 * pages - 12}: {whence}, {pages} pages of 4, and blocktopk attends {pages} .*: every "
             f"page, so it would never skip one: give a budget below {4 * pages - 12}$")]:
        with pytest.raises(SystemExit):
            S.main(argv + ["--candidates"] + flags)
        assert re.search(message, capsys.readouterr().err.splitlines()[-1])
    for flags in ([f"{row - 4},{row + 8}"], [f"{4 * pages - 13}", "--policy", "blocktopk"]):   # each evicts: sampled
        with pytest.raises(pytest.fail.Exception, match="calibrated"):
            S.main(argv + ["--candidates"] + flags)


@pytest.mark.parametrize("argv, message", [
    (["--candidates", "6,x"], "--candidates must be comma-separated integers, got '6,x'"),
    (["--threshold", "1.5"], "--threshold must lie in \\[0, 1\\], got 1.5"),
    (["--bin-size", "0"], "--bin-size must be >= 1, got 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--page-size", "0", "--speedup", "s.json"], "--page-size must be >= 1, got 0"),
    (["--calibrate", "--speedup", "missing.json"], "cannot read a schedule from missing.json"),
    (["--prompts", "0"], "--prompts must be >= 1, got 0"),
    (["--policy", "full"], "invalid choice: 'full'"),
    (["--policy", "blocktopk", "--candidates", "3,8"],          # the toy's pages, as train.py's: 4 tokens
     "budget=3 must be >= page_size = 4 \\(the budget: the smallest of --candidates\\)"),
    (["--policy", "blocktopk", "--page-size", "8"], "budget=6 must be >= page_size = 8"),
    (["--speedup", "s.json", "--context", "0"], "--context must be >= 1, got 0"),
    (["--speedup", "s.json", "--batch", "-4"], "--batch must be >= 1, got -4"),
    (["--speedup", "s.json", "--dense-layers", "-1"], "--dense-layers must be >= 0, got -1"),   # else L + 1 sparse
    (["--bin-size", str(2 ** 63)], "--bin-size must be < 2\\*\\*31, got 9223372036854775808"),   # an OverflowError
    (["--candidates", f"8,{2 ** 41}"], "--candidates must be at most 2\\*\\*40 \\(DENSE\\), got 2199023255552"),  # ditto
    (["--speedup", "s.json", "--context", str(2 ** 20 + 1)], "--context must be at most 2\\*\\*20 = 1048576 tokens, "
                                                             "got 1048577"),       # 10**11 ran for days
    (["--adapter", ""], "--adapter is empty: give a value, or leave the flag out"),     # was: silently no adapter
])
def test_the_command_line_refuses_bad_settings_before_loading_a_model(tmp_path, monkeypatch, capsys, argv, message):
    # the folder holds a warm-up's warmup.json and no weights: a check that came after loading would fail there
    monkeypatch.chdir(tmp_path)                        # --out's default folder, out/, is made before some refusals
    (tmp_path / "warmup.json").write_text(json.dumps(dict(task="pick", digits=[3, 4])))
    with pytest.raises(SystemExit):
        S.main((["--calibrate"] if "--speedup" not in argv else []) + ["--model", str(tmp_path)] + argv)
    assert re.search(message, capsys.readouterr().err)


def test_calibration_names_a_model_folder_that_is_not_there(tmp_path, capsys):
    with pytest.raises(SystemExit):
        S.main(["--calibrate", "--model", str(tmp_path / "nowhere")])
    assert f"--model '{tmp_path / 'nowhere'}': no such folder; run `python train.py` first" in capsys.readouterr().err


def test_calibration_refuses_a_checkpoint_of_a_real_model(tmp_path, capsys):
    # a --model run's args.json names the toy task too (the flag's default): its prompts are not the toy's
    (tmp_path / "args.json").write_text(json.dumps(dict(task="pick", digits=[3, 6], model="smollm2-135m")))
    with pytest.raises(SystemExit):
        S.main(["--calibrate", "--model", str(tmp_path)])
    assert "was trained from --model smollm2-135m: --calibrate takes the toy warm-up" in capsys.readouterr().err


@pytest.mark.parametrize("text, message", [                        # models.toy_settings' cases: tests/test_models.py
    ("{bad", "cannot read .*warmup.json: Expecting property"),
    ('{"digits": [3, 6]}', "holds no toy run's settings: a JSON object with task, digits$"),
])
def test_calibration_names_a_warmup_json_that_holds_no_run(tmp_path, capsys, text, message):
    (tmp_path / "warmup.json").write_text(text)                       # each was a traceback
    with pytest.raises(SystemExit):
        S.main(["--calibrate", "--model", str(tmp_path)])
    assert re.search(message, capsys.readouterr().err)


def test_speedup_of_a_long_schedule_at_a_short_context_leaves_out_the_stretched_row(tmp_path, capsys, monkeypatch):
    # stretched to fewer tokens than it spans, a schedule's bins would merge: that row is left out; at exactly the
    # tokens it spans (its last bin ends at 48) it would repeat the calibrated row as "x1" (a `factor >= 1` did)
    piecewise([0, 16, 32], [8, 12, 16]).save(tmp_path / "s.json")
    for context in ("2", "48"):
        S.main(["--speedup", str(tmp_path / "s.json"), "--context", context, "--batch", "1"])
        out = capsys.readouterr().out
        assert "as calibrated" in out and "stretched" not in out and "constant budget 8192" in out
    # and at a long context the row is there, priced on the schedule stretched by hand: its last bin ends at
    # 32 + 16 = 48, so 4800 tokens stretch it x100, bins and budgets alike. Only strings were checked: mutants
    # that priced the unstretched schedule, or stretched from the last bin's start (x150), passed
    priced = []
    monkeypatch.setattr(cost, "speedup", lambda config, schedule, context, **k: priced.append((schedule, context))
                        or 1.0)                                       # what cost.speedup_table calls
    S.main(["--speedup", str(tmp_path / "s.json"), "--context", "4800", "--batch", "1"])
    assert "the same stretched x100 to 4800 tokens" in capsys.readouterr().out
    shapes = len(cost.QWEN3)
    assert priced == [(s, 4800) for s in (piecewise([0, 16, 32], [8, 12, 16]),
                                          piecewise([0, 1600, 3200], [800, 1200, 1600]),
                                          constant(8192), constant(4096), constant(2048)) for _ in range(shapes)]


@pytest.mark.parametrize("argv, pages", [([], dict(page_size=16, dense_layers=2)),   # Sparrow's, as --help says
                                         (["--page-size", "8", "--dense-layers", "0"], dict(page_size=8,
                                                                                          dense_layers=0))])
def test_speedup_for_block_topk_prices_sparrows_pages_unless_flags_say_otherwise(tmp_path, monkeypatch, argv, pages):
    # Pins print_speedup's blocktopk defaults: pages of 16 and 2 dense layers with no flag, and an explicit
    # --dense-layers 0 kept (an `or` default would turn it into 2); another policy prices no pages at all.
    piecewise([0, 16], [8, 12]).save(tmp_path / "s.json")
    calls = []
    monkeypatch.setattr(cost, "speedup", lambda *a, **k: calls.append(k) or 1.0)   # what cost.speedup_table calls
    S.main(["--speedup", str(tmp_path / "s.json"), "--policy", "blocktopk", *argv])
    assert calls and all(k == dict(batch=64, **pages) for k in calls)
    calls.clear()
    S.main(["--speedup", str(tmp_path / "s.json"), "--policy", "snapkv", *argv])
    assert calls and all(k == dict(batch=64) for k in calls)


def test_speedup_after_a_calibration_prices_sparrows_pages_not_the_toys(tmp_path, monkeypatch):
    # --calibrate fills the flags not given with the toy's settings (pages of 4, 1 dense layer of its 2); the
    # --speedup of the same command priced Qwen3 with those (5.40x for 1.7B where --speedup alone said 7.51x)
    toy_warm_up(tmp_path / "m")
    calls = []
    monkeypatch.setattr(cost, "speedup", lambda *a, **k: calls.append(k) or 1.0)
    S.main(["--calibrate", "--model", str(tmp_path / "m"), "--prompts", "4", "--candidates", "8,12", "--policy",
            "blocktopk", "--out", str(tmp_path / "s.json"), "--speedup", str(tmp_path / "s.json")])
    assert calls and all(k == dict(batch=64, page_size=16, dense_layers=2) for k in calls)


def test_calibrate_writes_out_schedule_json_by_default(tmp_path):
    # Pins --out's default: out/, not the committed results/schedule.json that a bare --calibrate overwrote
    piecewise([0], [8]).save(tmp_path / "s.json")
    assert S.parse_args(["--speedup", str(tmp_path / "s.json")])[0].out == "out/schedule.json"


def test_speedup_alone_reads_its_schedule_even_at_the_default_out(tmp_path, monkeypatch):
    # Pins check_args' exception for --speedup == --out: only a --calibrate writes that file first; `--speedup
    # out/schedule.json` alone (--out's default) must read it now
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    piecewise([0, 16], [8, None]).save(tmp_path / "out" / "schedule.json")
    assert S.parse_args(["--speedup", "out/schedule.json"])[0].schedule == piecewise([0, 16], [8, None])


def test_speedup_of_the_file_calibrate_writes_spelled_another_way_is_the_new_schedule(tmp_path, monkeypatch):
    # --out out/s.json --speedup /abs/.../out/s.json name one file: compared as written, the old schedule in it was
    # read before calibrating and priced, not the one the calibration wrote over it
    monkeypatch.chdir(tmp_path)
    (tmp_path / "warmup.json").write_text(json.dumps(dict(task="pick", digits=[3, 4])))   # no weights: none load
    (tmp_path / "out").mkdir()
    piecewise([0], [4096]).save(tmp_path / "out" / "s.json")          # an earlier calibration's
    for speedup in (str(tmp_path / "out" / "s.json"), "./out/../out/s.json"):
        args, _ = S.parse_args(["--calibrate", "--model", str(tmp_path), "--out", "out/s.json", "--speedup", speedup])
        assert args.schedule is None                                   # main prices what print_calibration returns


def test_a_context_of_exactly_2_20_is_allowed(tmp_path):
    # Pins the bound "at most 2**20 = 1048576 tokens": 2**20 itself passes (2**20 + 1 is refused above)
    piecewise([0], [8]).save(tmp_path / "s.json")
    assert S.parse_args(["--speedup", str(tmp_path / "s.json"), "--context", str(2 ** 20)])[0].context == 1048576


# 6. the lab's edge cases (LAB.md): each test fails on a mistake a student could make writing tail_by_bin

def test_tail_by_bin_has_one_bin_per_bin_up_to_the_last_real_token():
    # the largest real position is 31: bins 0-15 and 16-31, no empty third bin; padding (-1, even at 90) is no token
    alpha = torch.tensor([[0.5, 0.7, 0.9, 0.3, 1.0]], dtype=torch.float64)
    tails, counts = tail_by_bin(alpha, torch.tensor([[0, 15, 16, 31, -1]]), bin_size=16, q=0.0)
    assert counts.tolist() == [2, 2] and tails.tolist() == [0.5, 0.3]
    tails, counts = tail_by_bin(alpha, torch.tensor([[0, 15, 16, 32, -1]]), bin_size=16, q=0.0)
    assert counts.tolist() == [2, 1, 1] and tails.tolist() == [0.5, 0.9, 0.3]
    tails, counts = tail_by_bin(torch.ones(2), torch.tensor([-1, -1]), bin_size=16)
    assert tails.shape == counts.shape == (0,)


def test_tail_by_bin_uses_q():
    alpha = torch.tensor([0.5, 0.1, 0.4, 0.2, 0.3], dtype=torch.float64)
    positions = torch.zeros(5, dtype=torch.long)
    # sorted 0.1 .. 0.5; quantile q sits at index 4 q, interpolated linearly (as np.quantile)
    for q, expected in [(0.0, 0.1), (0.25, 0.2), (0.5, 0.3), (0.1, 0.14), (0.9, 0.46), (1.0, 0.5)]:
        assert tail_by_bin(alpha, positions, bin_size=16, q=q)[0].item() == pytest.approx(expected, abs=1e-12)


def test_tail_by_bin_returns_float64_tails_computed_in_float64_and_long_counts():
    # float32 alpha in: the quantile is taken in float64, a0 + 0.3 (a1 - a0) with a0, a1 the float32 values
    alpha = torch.tensor([0.1, 0.7], dtype=torch.float32)
    tails, counts = tail_by_bin(alpha, torch.tensor([3, 5]), bin_size=16, q=0.3)
    assert tails.dtype == torch.float64 and counts.dtype == torch.long
    a0, a1 = alpha.tolist()
    assert tails.item() == pytest.approx(a0 + 0.3 * (a1 - a0), rel=1e-12)
    assert tails.item() != pytest.approx(torch.quantile(alpha, 0.3).item(), rel=1e-12)   # float32 is off here


def test_an_out_under_a_file_is_refused_before_calibrating(tmp_path, capsys):
    (tmp_path / "warmup.json").write_text(json.dumps(dict(task="pick", digits=[3, 4])))   # no weights: no model loads
    (tmp_path / "afile").write_text("")
    for out in (tmp_path / "afile" / "s.json", tmp_path):                # under a file; a folder
        with pytest.raises(SystemExit):
            S.main(["--calibrate", "--model", str(tmp_path), "--out", str(out)])
        assert "--out" in capsys.readouterr().err


def test_a_kill_while_saving_keeps_the_old_schedule_whole(tmp_path, monkeypatch):
    # save wrote the file in place: a kill mid-write left a torn schedule.json that train.py --schedule refuses
    path = tmp_path / "s.json"
    piecewise([0, 16], [8, 12]).save(path)
    old = path.read_text()

    def write_half(self, text, *args, **kwargs):
        with open(self, "w") as f:
            f.write(text[: len(text) // 2])
        raise KeyboardInterrupt
    monkeypatch.setattr(S.Path, "write_text", write_half)
    with pytest.raises(KeyboardInterrupt):
        piecewise([0, 16, 32], [8, 12, 16]).save(path)
    assert path.read_text() == old


def test_speedup_refuses_dense_layers_past_the_smallest_qwen3(tmp_path, capsys):
    # --policy blocktopk --dense-layers 99 priced every layer dense: 1.00x in every column, silently
    piecewise([0, 16], [8, 12]).save(tmp_path / "s.json")
    with pytest.raises(SystemExit):
        S.main(["--speedup", str(tmp_path / "s.json"), "--policy", "blocktopk", "--dense-layers", "28"])
    assert capsys.readouterr().err.splitlines()[-1].split(": ", 1)[1] == ("error: --dense-layers 28: Qwen3-1.7B has 28 "
                                                        "layers, so block top-k would attend to every token in each; "
                                                        "give at most 27")


def test_calibration_refuses_dense_layers_past_the_warm_ups_layers(tmp_path, capsys):
    # on the 2-layer toy, --dense-layers 2 calibrated a full cache: every candidate "held", a meaningless schedule
    tokenizer = tasks.char_tokenizer()
    models.toy_model(tokenizer).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "warmup.json").write_text(json.dumps(dict(task="pick", digits=[3, 6])))
    with pytest.raises(SystemExit):
        S.main(["--calibrate", "--model", str(tmp_path), "--policy", "blocktopk", "--dense-layers", "2",
                "--out", str(tmp_path / "s.json")])
    assert capsys.readouterr().err.splitlines()[-1].split(": ", 1)[1] == ("error: --dense-layers 2: the model has 2 layers, "
                                                        "so block top-k would attend to every token in each; give at "
                                                        "most 1")
    assert not (tmp_path / "s.json").exists()


# 7. mutation tests: each fails on one small change to schedule.py that the tests above let through

def test_a_schedule_at_an_int_context_is_an_int_and_bin_metrics_write_as_json():
    # Pins Schedule.__call__'s int for an int (at a bin start and past it; dense is DENSE) and so bin_metrics'
    # plain ints: train.py writes them with json.dumps into metrics.jsonl, and a 0-d tensor there (a __call__
    # returning values[index] as is) stopped the step with "Object of type Tensor is not JSON serializable",
    # though [tensor(10)] == [10] holds in a list comparison
    schedule = piecewise([0, 8], [6, None])
    for context, expected in [(0, 6), (7, 6), (8, DENSE), (1000, DENSE)]:
        assert type(schedule(context)) is int and schedule(context) == expected
    m = bin_metrics(torch.ones(1, 3), torch.tensor([[3, 9, 20]]), 8, piecewise([0, 4, 16], [6, 10, None]))
    assert json.loads(json.dumps(m))["budget_by_bin"] == [10, 10, None]


def test_bin_metrics_rounds_tails_to_4_places():
    # Pins the 4 places of alpha_p05_by_bin (a round to 2 passed test_bin_metrics_by_hand, whose tail is 0.1):
    # one token per bin, so the tail is that token's alpha, 0.123456 -> 0.1235 and 0.98765 -> 0.9877 (0.12, 0.99)
    m = bin_metrics(torch.tensor([[0.123456, 0.98765]], dtype=torch.float64), torch.tensor([[1, 9]]), 8, None)
    assert m["alpha_p05_by_bin"] == [0.1235, 0.9877]


def test_calibrate_profiles_and_re_measures_at_its_q(monkeypatch):
    # Pins calibrate's q in both measurements (every other calibrate test uses the default 0.05, so dropping q
    # from either tail_by_bin's or by_bin's call passed). `simulated_streaming` with the first D above: at a
    # constant budget 2 bins 2 and 3 each hold one token at 0.5 and three at 0.86; their median (q = 0.5) is
    # (0.86 + 0.86) / 2 = 0.86 >= 0.86, so every bin holds at the smallest candidate, 2, and the schedule of 2s,
    # re-measured, holds at 0.86 too: one schedule tried. (Profiled at 0.05: [2, 2, 4, 8, 8], as above;
    # re-measured at 0.05: bin 2 fails at 0.554 and a bin is raised, a second schedule tried.)
    D = {c: {8: 4, 12: 6}.get(c, 2) for c in range(4, 20)}
    tried = simulated_streaming(monkeypatch, D)
    sparse = SparseConfig("streaming", budget=2, interval=1, window=1, sink=0)
    schedule, rows = calibrate(None, None, candidates=[2, 4, 8], bin_size=4, sparse=sparse, q=0.5)
    assert tried == [[2, 2, 2, 2, 2]] and schedule == piecewise([0, 4, 8, 12, 16], [2, 2, 2, 2, 2])
    assert [r["tail"] for r in rows[1:]] == [THRESHOLD] * 4 and [r["profile"][0] for r in rows[1:]] == [THRESHOLD] * 4


def test_calibrate_for_block_topk_stops_at_a_bin_that_fails_dense(monkeypatch):
    # Pins blamed_bin's `budgets[i] is not None` under block top-k: a dense bin attends every page, so it is to
    # blame for nothing (without the check, attended_pages(None, 16) raised a TypeError mid-calibration). A
    # stand-in for `measure`, contexts 0-255, bins of 128: bin 1 fails at every budget, dense too. By hand: held
    # at 128, bin 1 fails -> dense (None); re-measured under [128, None] it still fails, no bin is to blame (bin 0
    # holds; bin 1 is dense): calibrate stops there, bin 1 below the threshold.
    def fake_measure(model, prompts, sparse, max_new_tokens, **sampling):
        contexts = torch.arange(256)
        return torch.where(contexts < 128, 1.0, 0.5).double()[None], contexts[None]

    monkeypatch.setattr(S, "measure", fake_measure)
    sparse = SparseConfig("blocktopk", budget=128, interval=128, page_size=16)
    schedule, rows = calibrate(None, None, candidates=[128], bin_size=128, sparse=sparse)
    assert schedule == piecewise([0, 128], [128, None]) and [r["tail"] for r in rows] == [1.0, 0.5]
    assert S.blamed_bin(1, [128, None], [127, 255], [], page_size=16) is None      # the rule itself, by hand


def test_an_empty_schedule_is_a_clear_error_and_an_empty_file_is_named(tmp_path):
    # Pins Schedule's `len(bins) == 0` check: without it piecewise([], []) passed the length check and stopped on
    # bins[0], an IndexError naming nothing, which Schedule.load (it turns ValueError, not IndexError, into one
    # naming the file) let through as a traceback for a file of {"bins": [], "budgets": []}
    with pytest.raises(ValueError, match="need one budget per bin, got 0 bins and 0 budgets"):
        piecewise([], [])
    (tmp_path / "empty.json").write_text('{"bins": [], "budgets": []}')
    with pytest.raises(ValueError, match="cannot read a schedule from .*empty.json: need one budget per bin"):
        Schedule.load(tmp_path / "empty.json")


def test_blamed_bin_by_hand_and_by_bins_default_q():
    """Pins blamed_bin's page count and `seen`, which calibrate's tests reach only at page boundaries they do not
    cross and without `seen` (the controller's), and by_bin's default q, 0.05 (docs/method.md section 4; each
    caller here passed q). Mutants caught: `int(longest) // page_size + 1` pages, `attended < pages` as `<=`,
    the `seen` filter dropped, by_bin's q=0.1."""
    # block top-k, pages of 16: budget 192 attends 192 // 16 + 3 = 15 pages; the longest context 240 holds tokens
    # 0..239, 15 pages (nothing skipped: None); 241 holds 16 (bin 1 skips one: bin 1 itself)
    assert S.blamed_bin(1, [128, 192], [127, 240], [], page_size=16) is None
    assert S.blamed_bin(1, [128, 192], [127, 241], [], page_size=16) == 1
    # eviction: the latest compressing bin up to i among those measured; bin 1 unmeasured is no culprit
    assert S.blamed_bin(2, [4, 4, 4], [3, 7, 11], [0, 1]) == 1
    assert S.blamed_bin(2, [4, 4, 4], [3, 7, 11], [0, 1], seen={0, 2}) == 0
    # by_bin without q: the 5th percentile of bin 0's [0.0, 0.5, 1.0, 1.0, 1.0] is 0.1 (numpy's, linear; 0.1: 0.2)
    alpha = torch.tensor([[0.0, 0.5, 1.0, 1.0, 1.0]], dtype=torch.float64)
    tails = S.by_bin(alpha, torch.tensor([[0, 1, 2, 3, 4]]), constant(8), 8)[0]
    assert tails.tolist() == pytest.approx([np.quantile(alpha.numpy(), 0.05)]) == [0.1]
