"""controller.py: the online controller's moves by hand, on a real cache's rollouts, and its bad settings.

Each test compares with a hand calculation (the budgets after each update, worked out in its comment) or with
the tail measured on fresh samples, so it can fail."""
import pytest
import torch

from controller import Controller
from kvcache import SparseConfig
from reference import tiny_model
from schedule import compressed_bins, measure, piecewise, tail_by_bin
from test_schedule import PROMPTS, SPARSE


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def by_hand(budgets=None, **changes):
    """The controller the tests below work out by hand: bins of 32, interval 1, threshold 0.75, band 0.125, step 8,
    up 1.5, budgets in [20, 100], min_tokens 2, start 24; `changes` replace any of these. `budgets`: its schedule set
    by hand, one budget per bin from 0 (none: two bins at the start budget)."""
    c = Controller(**dict(dict(threshold=0.75, bin_size=32, bins=2 if budgets is None else len(budgets), start=24,
                               low=20, high=100, step=8, up=1.5, band=0.125, min_tokens=2), **changes))
    if budgets is not None:
        c.schedule = piecewise([32 * i for i in range(len(budgets))], budgets)
    return c


def test_controller_holds_the_tail_in_its_band_with_budgets_that_grow_with_the_context(model):
    # (With the authors' SnapKV scoring, a constant budget at the controller's token-weighted mean, 13, also
    # holds 0.97 on this tiny random model, at 0.9700 in its worst bin: the controller's gain is not shown here.)
    controller = Controller(threshold=0.97, bin_size=8, bins=6, start=6, low=6, high=64, step=2, band=0.01,
                            min_tokens=5)
    sparse = SparseConfig(**{**vars(SPARSE), "schedule": controller})
    for seed in range(6):                                               # six rollout batches, then fresh samples
        controller.update(*measure(model, PROMPTS, sparse, 20, seed=seed))
    alpha, positions = measure(model, PROMPTS, sparse, 20, seed=100)
    tails, counts = tail_by_bin(alpha, positions, 8)
    held = [t for t, c in zip(tails.tolist(), counts.tolist()) if c >= 5]
    assert all(0.97 <= t <= 0.97 + 0.02 for t in held)                   # the stated band: [target, target + 0.02]
    budgets = list(controller.budgets)
    assert budgets == sorted(budgets) and budgets[-1] > budgets[0]     # moved, and non-decreasing in the context


def test_a_bin_that_compresses_nothing_is_not_blamed_though_its_contexts_pass_its_budget():
    # One row, a 4-token prompt and 28 new tokens, interval 1, budgets 8 (contexts 0-15) and 24 (16-31): bin 0
    # compresses at contexts 9-15 and leaves 8 tokens; in bin 1 the row grows from 9 to 24 tokens, never 25,
    # though its contexts reach 31 >= 24 + 1. Bin 1 fails: what it misses bin 0 dropped, so bin 0 goes up, x1.5.
    c = Controller(threshold=0.9, bin_size=16, bins=2, start=8, low=8, high=64, up=1.5, min_tokens=1)
    c.schedule = piecewise([0, 16], [8, 24])
    positions = torch.arange(4, 32)[None]
    assert compressed_bins(positions, c.schedule, 16, 1) == [0]
    c.update(torch.where(positions < 16, 1.0, 0.5).double(), positions)
    assert c.budgets == (12, 24)                                         # counting contexts raised bin 1: (8, 36)


def test_a_failing_bin_raises_the_bin_whose_eviction_it_suffers():
    # Bins of 16, interval 1; one row, `near` sampled at contexts 5-41: its cache reaches 25 tokens at context 25
    # and compresses through bin 1, keeping 24; at 54, bin 2 (the row holds 25-34 tokens) compresses nothing.
    # Bin 2 fails: what it misses was dropped in bin 1, which is raised x1.5. No bin is lowered: one at or after
    # each of them failed.
    c = Controller(threshold=0.9, bin_size=16, bins=3, start=24, low=8, step=4, up=1.5, band=0.03, min_tokens=2)
    c.schedule = piecewise([0, 16, 32], [24, 24, 54])
    near, far = torch.tensor([[5, 6, 28, 30, 40, 41]]), torch.tensor([[5, 6, 28, 30, 60, 61]])
    c.update(torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.1, 0.1]]), near)
    assert c.budgets == (24, 36, 54)
    c.update(torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.1, 0.1]]), far)      # 55 tokens at context 55: bin 2 compresses
    assert c.budgets == (24, 36, 81)
    c.update(torch.tensor([[1.0, 1.0, 0.5, 0.5, 1.0, 1.0]]), near)     # bin 1 fails; no bin up to it compresses:
    assert c.budgets == (24, 36, 77)                                     # nothing raised; bin 2 holds, lowered
    c.update(torch.ones(1, 6), near)                                     # every bin holds: all lowered by 4
    assert c.budgets == (20, 32, 73)
    c.update(torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.1, 0.1]]), torch.tensor([[5, 6, 28, 30, 200, 300]]))
    assert c.budgets == (20, 32, 110)                                    # contexts past the last bin count in it


def test_controller_raises_a_blamed_bin_once_and_never_one_it_did_not_see():
    # Pins update's blame set and its `seen`: two failing bins that blame the same bin raise it once (a list
    # would raise 20 twice, to 45), and a bin with fewer than min_tokens tokens is no culprit (without `seen`,
    # bin 1, where the row compresses from context 37 on, would be the latest bin that evicts: 24 -> 36).
    c = by_hand([20, 60, 80])                          # bins 1, 2 fail, compress nothing (the row holds <= 54): bin 0
    c.update(torch.tensor([[1.0, 1.0, 0.5, 0.5, 0.5, 0.5]]), torch.tensor([[25, 30, 40, 50, 64, 65]]))
    assert c.budgets == (30, 60, 80)                   # 20 * 1.5 once; bin 0 not lowered: later bins failed
    c.schedule = piecewise([0, 32, 64], [20, 24, 80])  # bin 1 holds one token only: unseen; bin 2 fails -> bin 0
    c.update(torch.tensor([[1.0, 1.0, 1.0, 0.5, 0.5]]), torch.tensor([[25, 30, 50, 64, 65]]))
    assert c.budgets == (30, 30, 80)                   # bin 1 lifted by the running max only


def test_controller_for_block_topk_raises_the_failing_bin_itself():
    # Block top-k, pages of 16, budget 128, bins of 128, interval 128. Bin 1 (contexts 128-255) fails at alpha 0.5:
    # its longest context, 255, has 16 pages, more than the 128 // 16 + 3 = 11 it attends, and nothing was
    # dropped for good, so bin 1 itself goes up: 128 * 1.5 = 192 (and bin 2 with it: non-decreasing). The
    # eviction rule (a bin evicts once its contexts reach budget + interval = 256) would find no bin to raise.
    c = Controller(threshold=0.86, bin_size=128, bins=3, start=128, low=16, interval=128, min_tokens=1,
                   page_size=16)
    contexts = torch.tensor([[10, 60, 130, 200, 255]])
    c.update(torch.tensor([[1.0, 1.0, 0.5, 0.5, 0.5]]), contexts)
    assert c.budgets == (128, 192, 192)
    # a failing bin that attends every page of its contexts is dense there: eviction is not the cause
    c = Controller(threshold=0.86, bin_size=128, bins=2, start=128, low=16, interval=128, min_tokens=1,
                   page_size=16)
    c.update(torch.tensor([[1.0, 0.5, 0.5]]), torch.tensor([[10, 130, 175]]))    # 11 pages = 176 tokens: all
    assert c.budgets == (128, 128)
    c.update(torch.tensor([[1.0, 0.5, 0.5]]), torch.tensor([[10, 130, 176]]))    # 176 tokens: still 11 pages
    assert c.budgets == (128, 128)
    c.update(torch.tensor([[1.0, 0.5, 0.5]]), torch.tensor([[10, 130, 177]]))    # 177: a 12th page, not attended
    assert c.budgets == (128, 192)


def test_controller_edges_by_hand():
    """Each edge of the rule by hand (bins of 32, interval 1, threshold 0.75, band 0.125, step 8, up 1.5, budgets
    in [20, 100], alpha [1, 6]: two tokens per bin, one row sampled at contexts 5-65): a tail equal to the threshold
    holds; a bin compresses once its row holds budget + interval tokens exactly; the latest earlier bin that
    compresses is the culprit, not the first; budgets are capped at `high` and floored at `low`; a tail at exactly
    threshold + band is not lowered."""
    alpha = lambda *tails: torch.tensor([[t for t in tails for _ in range(2)]])
    row = torch.tensor([[5, 6, 40, 41, 64, 65]])
    c = by_hand((24, 55, 64))                # bin 0 leaves 24 tokens at context 31, so at 63 the row holds 56 =
    c.update(alpha(1.0, 0.5, 0.75), row)     # 55 + 1: bin 1 compresses, 55 -> 83 (bin 2 lifted with it); bin 2,
    assert c.budgets == (24, 83, 83)         # at the threshold, holds
    c = by_hand((24, 56, 64))                # at 56, 56 tokens are not 57: bin 1 compresses nothing, bin 0 is the
    c.update(alpha(1.0, 0.5, 0.75), row)     # culprit, 24 -> 36; not lowered, since bin 1 after it failed
    assert c.budgets == (36, 56, 64)
    c = by_hand((20, 24, 80))                # a row at contexts 25-65: bin 2 fails, compresses nothing (the row
    c.update(alpha(1.0, 1.0, 0.5), torch.tensor([[25, 30, 40, 50, 64, 65]]))   # holds <= 26); bins 0 (from
    assert c.budgets == (20, 36, 80)         # 26) and 1 (from 36) both do: the latest, bin 1, is raised, 24 -> 36
    c = by_hand((20, 24, 80))                # bin 2 fails at contexts up to 200 (past the last bin: counted in it),
    c.update(alpha(1.0, 1.0, 0.5), torch.tensor([[25, 30, 40, 50, 90, 200]]))   # compressing from 120 on:
    assert c.budgets == (20, 24, 100)        # 80 * 1.5 = 120, capped at high = 100
    c = by_hand((24, 40, 64))                # every bin holds: lowered by 8, bin 0 floored at low = 20; bin 1 sits
    c.update(alpha(1.0, 0.875, 1.0), torch.tensor([[5, 6, 40, 41, 64, 65]]))   # at threshold + band: kept
    assert c.budgets == (20, 40, 56)
    c = Controller(threshold=0.9, bin_size=16, bins=2, start=4, low=1, high=64, up=1.1, min_tokens=1)
    for raised in ((5, 5), (6, 6)):          # a gentle up still raises a failing bin by a token: round(4 * 1.1) is 4
        c.update(torch.full((1, 30), 0.5), torch.arange(30)[None] + 2)
        assert c.budgets == raised


def test_controller_leaves_a_bin_whose_tail_equals_the_threshold_alone():
    # threshold 0.75, band 0.125, bins of 32, interval 1, budgets (24, 55, 64), one row at contexts 5-65: bins 0
    # and 1 compress (at 63 the row holds 56 = 55 + 1), bin 2 does not. Bin 2's tail is exactly the threshold: it
    # holds (< is the rule), so no bin is raised; bins 0 and 1, above threshold + band with no failing bin at or
    # after them, are lowered by 8 (bin 0 floored at 20), bin 2 stays. Counting 0.75 as failing blames bin 1
    # (the latest that compresses): 55 -> 83, and nothing lowered: (24, 83, 83).
    c = by_hand((24, 55, 64))
    c.update(torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.75, 0.75]]), torch.tensor([[5, 6, 40, 41, 64, 65]]))
    assert c.budgets == (20, 47, 64)


def test_controller_leaves_a_bin_with_fewer_than_min_tokens_alone_though_its_tail_fails():
    """min_tokens=2, threshold 0.75, band 0.125, bins of 32, interval 1, budgets (24, 40, 64); one row at contexts
    5, 6, 40, 41, 64: bins 0 and 1 hold two tokens at alpha 1, bin 2 one token at 0.5. By hand: bin 2 is too thin
    to read, so nothing fails; bins 0 and 1 sit above threshold + band and are lowered by 8 (bin 0 floored at 20):
    (20, 32, 64). Counting the thin bin as failing would raise the latest compressing bin it saw (bin 1: 40 -> 60)
    and keep bins 0 and 1 from being lowered: (24, 60, 64)."""
    c = by_hand((24, 40, 64))
    c.update(torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.5]]), torch.tensor([[5, 6, 40, 41, 64]]))
    assert c.budgets == (20, 32, 64)


@pytest.mark.parametrize("interval, budgets", [(1, (36, 36)), (4, (24, 24))])
def test_controller_blames_by_its_own_interval(interval, budgets):
    """Budget 24, one row sampled at contexts 20-26 (its prompt keeps 20 tokens), every alpha 0.5 < 0.75: bin 0
    fails. By hand, at interval 1 the row holds 25 = 24 + 1 at context 25 and compresses, so bin 0 is to blame:
    24 * 1.5 = 36. At interval 4 it would compress once it held 28, and it holds at most 26: no bin compressed,
    eviction is not the cause, nothing moves (and a failing bin is not lowered)."""
    c = by_hand(interval=interval)
    c.update(torch.full((1, 7), 0.5), torch.arange(20, 27)[None])
    assert c.budgets == budgets


@pytest.mark.parametrize("make, message", [
    # refused when made, naming the setting: a fractional step or low failed at the first update (Schedule's
    # "budgets must be positive integers"), interval 0 blamed bins where the cache compresses nothing
    (lambda: Controller(threshold=1.5), "threshold must lie in \\[0, 1\\], got 1.5"),
    (lambda: Controller(bin_size=16.0), "bin_size must be a positive integer, got 16.0"),
    (lambda: Controller(up=1.0), "need 1 < up < inf, step >= 0 and band >= 0, got 1.0, 8, 0.03"),
    (lambda: Controller(step=-8), "need 1 < up < inf, step >= 0 and band >= 0, got 1.5, -8, 0.03"),
    # up inf passed, and the first update that raised a bin stopped on int(inf): an OverflowError naming nothing
    (lambda: Controller(up=float("inf")), "need 1 < up < inf, step >= 0 and band >= 0, got inf, 8, 0.03"),
    (lambda: Controller(step=2.5), "^step must be an integer, got 2.5$"),
    (lambda: Controller(low=2.5, start=6), "^low must be an integer, got 2.5$"),
    (lambda: Controller(start=64.0), "^start must be an integer, got 64.0$"),
    (lambda: Controller(bins=2.5), "^bins must be an integer >= 1, got 2.5$"),
    (lambda: Controller(bins=0), "^bins must be an integer >= 1, got 0$"),
    (lambda: Controller(interval=0), "^interval must be an integer >= 1, got 0$"),
    # the order of the budget bounds, each link of it (a start above high began outside [low, high]; low 0 a
    # budget of 0 tokens), a negative band, and a bool where a count belongs (True is an int)
    (lambda: Controller(start=200, high=100), "^need 1 <= low <= start <= high, got 16, 200, 100$"),
    (lambda: Controller(low=0), "^need 1 <= low <= start <= high, got 0, 64, 4096$"),
    (lambda: Controller(band=-0.01), "need 1 < up < inf, step >= 0 and band >= 0, got 1.5, 8, -0.01"),
    (lambda: Controller(interval=True), "^interval must be an integer >= 1, got True$"),
])
def test_bad_settings_are_a_clear_error(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_controller_reads_the_tail_at_its_q():
    # Pins update's q (every test above uses the default 0.05, so by_bin called without it passed). Budget 24,
    # bins of 32, one row at contexts 20-26 (it compresses at 25: bin 0 evicts), alpha 0 once and 1 six times. By
    # hand: at q = 0.5 the tail is the median, 1.0 > 0.75 + 0.125, so bin 0 is lowered by 8, 24 -> 16 (bin 1 holds
    # no token: left alone). At q = 0.05 it is 0.3 * 1.0 = 0.3 < 0.75: bin 0 fails and is raised, 24 -> 36.
    for q, budgets in [(0.5, (16, 24)), (0.05, (36, 36))]:
        c = by_hand(low=8, q=q)
        c.update(torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]]), torch.arange(20, 27)[None])
        assert c.budgets == budgets


def test_controller_does_not_lower_a_bin_with_fewer_than_min_tokens_though_its_tail_holds():
    # Pins the `seen` of update's lowering loop (the test above pins it for a failing bin): min_tokens=2, budgets
    # (24, 40, 64), one row at contexts 5, 6, 40, 41, 64, every alpha 1.0. By hand: nothing fails; bins 0 and 1
    # are lowered by 8 (bin 0 floored at 20); bin 2 holds one token, too thin to read: kept at 64. Lowering every
    # bin above threshold + band would give (20, 32, 56).
    c = by_hand((24, 40, 64))
    c.update(torch.ones(1, 5), torch.tensor([[5, 6, 40, 41, 64]]))
    assert c.budgets == (20, 32, 64)


def test_controller_with_step_0_only_raises():
    """step >= 0 is the rule: step 0 is a controller that never lowers a budget. By hand (bins of 32, budgets 24,
    one row at contexts 20-26 that compresses at 25): every alpha 1.0 > 0.75 + 0.125 keeps (24, 24) where step 8
    would give (16, 24); every alpha 0.5 fails bin 0, which is raised, 24 * 1.5 = 36 (bin 1 lifted with it)."""
    c = by_hand(low=8, step=0)
    c.update(torch.ones(1, 7), torch.arange(20, 27)[None])
    assert c.budgets == (24, 24)
    c.update(torch.full((1, 7), 0.5), torch.arange(20, 27)[None])
    assert c.budgets == (36, 36)


def test_controller_reads_the_5th_percentile_by_default():
    # Pins the default q, 0.05 (docs/method.md section 6: "5th-percentile acceptance"; train.py passes no q, so
    # every --controller run reads this one). Same row as the test above, alpha 0 once and 1 six times, threshold
    # 0.5: the 5th percentile, 0.3, fails and bin 0 (it compresses at 25) is raised, 24 -> 36; a 10th, 0.6, holds
    # (not above 0.5 + 0.125 either): nothing would move.
    c = by_hand(threshold=0.5, low=8)
    c.update(torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]]), torch.arange(20, 27)[None])
    assert c.budgets == (36, 36)
