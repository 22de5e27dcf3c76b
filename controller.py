"""An online sparsity schedule (ours, not in Sparrow; docs/method.md section 6): per-bin budgets nudged after every
rollout batch toward the acceptance threshold, with no offline profiling.

Sparrow calibrates its schedule once, offline (`schedule.calibrate`). The controller instead reads the acceptance
alpha that every training step already measures (dense re-scoring at the sampler's top-k ids, section 4) and moves
each length bin's budget: up fast where the tail falls below the threshold, blaming the bin whose eviction caused
it (`schedule.blamed_bin`, as calibrate does), down slowly where it holds with room to spare.

    python train.py --controller 0.86     # train.sparse_config builds one; rl_step updates it after each step
"""
from itertools import accumulate

from schedule import THRESHOLD, blamed_bin, by_bin, check_bins, piecewise

HIGH = 4096       # the controller's largest budget by default (train.py's: the larger of it and --budget)


class Controller:
    """An online schedule: per-bin budgets that follow the measured tail, with no offline profiling.

    The probe is free: after each rollout batch the trainer already re-scores every sampled token densely
    (pi_old, docs/method.md section 1) at the sampler's top-k ids, so `update(alpha, positions)` costs a quantile
    per bin and no forward pass. The rule, per update:
    - a bin whose tail is below `threshold` multiplies `blamed_bin`'s budget by `up` (fast: a collapse is
      costly); if it blames none, eviction is not the cause and nothing moves;
    - a bin above `threshold + band`, with no failing bin at or after it, lowers its budget by `step` (slow);
    - bins with fewer than `min_tokens` tokens are left alone; contexts past the last bin count in it (its
      budget holds there); budgets stay in [low, high] and non-decreasing.
    Usable wherever a Schedule is: `SparseConfig(policy, schedule=controller)`.
    """

    def __init__(self, threshold=THRESHOLD, bin_size=16, bins=8, start=64, low=16, high=HIGH,
                 step=8, up=1.5, band=0.03, min_tokens=20, q=0.05, interval=1, page_size=None):
        # whole tokens: a step of 2.5 made budgets of 21.5, refused by the first update's Schedule, naming no
        # setting; interval >= 1, as the cache's (at 0 the replay blamed bins whose rows only reached their budget)
        for name, value in dict(bins=bins, start=start, low=low, high=high, step=step, interval=interval).items():
            if not isinstance(value, int) or isinstance(value, bool) or (name in ("bins", "interval") and value < 1):
                raise ValueError(f"{name} must be an integer{' >= 1' * (name in ('bins', 'interval'))}, got {value!r}")
        if not 1 <= low <= start <= high:
            raise ValueError(f"need 1 <= low <= start <= high, got {low}, {start}, {high}")
        if not (1 < up < float("inf") and step >= 0 and band >= 0):     # a raise rounds budget * up to an int
            raise ValueError(f"need 1 < up < inf, step >= 0 and band >= 0, got {up}, {step}, {band}")
        check_bins(bin_size, q, threshold)
        self.threshold, self.q, self.min_tokens = threshold, q, min_tokens          # what holds, on how many tokens
        self.low, self.high, self.step, self.up, self.band = low, high, step, up, band   # how a budget moves
        self.bin_size, self.interval, self.page_size = bin_size, interval, page_size    # how the cache compresses
        self.schedule = piecewise([i * bin_size for i in range(bins)], [start] * bins)

    bins = property(lambda self: self.schedule.bins)         # read-only, as a Schedule's: the current schedule's
    budgets = property(lambda self: self.schedule.budgets)

    def __repr__(self):
        return f"Controller(threshold={self.threshold}, bins={list(self.bins)}, budgets={list(self.budgets)})"

    def __call__(self, context):
        return self.schedule(context)

    def update(self, alpha, positions):
        """Move the budgets toward the threshold from one batch's alpha, positions [N, T] (sampled under the
        current schedule); -> the new Schedule."""
        tails, counts, longest, compressed = by_bin(alpha, positions, self.schedule, self.bin_size, self.interval,
                                                    self.q)
        budgets, seen = list(self.budgets), [i for i in range(len(tails)) if counts[i] >= self.min_tokens]
        failing = [i for i in seen if tails[i] < self.threshold]
        for j in {blamed_bin(i, budgets, longest, compressed, self.page_size, seen) for i in failing} - {None}:
            budgets[j] = min(self.high, max(budgets[j] + 1, int(budgets[j] * self.up + 0.5)))   # 4 * 1.1: 5
        for i in seen:
            if tails[i] > self.threshold + self.band and not any(f >= i for f in failing):
                budgets[i] = max(self.low, budgets[i] - self.step)
        self.schedule = piecewise(self.bins, list(accumulate(budgets, max)))   # running max: non-decreasing
        return self.schedule
