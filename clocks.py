"""How the benches time work and attribute the time: to a call, to choosing what to keep, to other processes.

Every clock here reads `sampler.clock(device)`, which on a GPU synchronises first: CUDA runs kernels
asynchronously, so an unsynchronised clock times their launch, not the work. Timings are measurements, never
assertions: the tests check only how the clocks count, on fake clocks, never a speed.
- `timed` / `rate`: one call's seconds; work per second, the median of repeated calls after a warm-up call.
  `copy_bandwidth` is such a rate: bytes per second of a tensor copy, the memory bound the benches compare with.
- `run_clocks`: a stamp at every forward pass, and how many cores other processes kept busy meanwhile
  (`others_jiffies`, from Linux's /proc): a disturbed run is listed, not trusted.
- `eviction_clock`: the seconds spent choosing (what to evict, or which pages) inside a rollout.

bench.py times its CPU runs with all of them (`bench.run`, `overheads`, `limit`); bench_gpu.py times re-scoring
with `timed` and the card's bandwidth with `copy_bandwidth`, and its decode windows on `sampler.clock` itself
(a stamp at every step would synchronise, stalling the queue):

    with eviction_clock() as spent, run_clocks(model) as (stamps, others):
        seconds, out = timed(lambda: generate(model, prompts, sparse, max_new_tokens=64), model.device)
"""
import os
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from unittest.mock import patch

import torch

import kvcache
from sampler import clock


def timed(fn, device="cpu"):
    """(seconds that fn() took on `device`, what it returned), on the synchronised `sampler.clock`."""
    start = clock(device)
    result = fn()
    return clock(device) - start, result


def rate(work, fn, device="cpu", repeats=5):
    """`work` per second of fn(): the median of `repeats` synchronised timings after one warm-up call."""
    fn()
    return work / statistics.median(timed(fn, device)[0] for _ in range(repeats))


def copy_bandwidth(values, device="cpu", repeats=5):
    """Bytes per second of copying `values` fp32 numbers to a second buffer on `device`, read + write counted."""
    src, dst = torch.ones(values, device=device), torch.empty(values, device=device)
    return rate(2 * src.nbytes, lambda: dst.copy_(src), device, repeats)


def others_jiffies():
    """Busy jiffies of the whole machine less this process's own, or None where /proc is missing (not Linux)."""
    try:
        # the "cpu" line, up to steal: guest and guest_nice (fields 9 and 10) are counted in user and nice already
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()   # after the command name
        return sum(fields) - fields[3] - fields[4] - int(own[11]) - int(own[12])   # less idle, iowait and ours
    except (OSError, IndexError, ValueError):
        return None


@contextmanager
def run_clocks(model):
    """The clocks of a run, HF's and ours alike: timestamps of every forward pass (prefill, then one per decode
    step), and the cores that other processes kept busy, on average, during the block (its disturbance).
    On CUDA each stamp synchronises, which stalls the queue: bench_gpu.py times whole windows instead."""
    stamps, others, before, start = [], [None], others_jiffies(), time.perf_counter()
    handle = model.register_forward_pre_hook(lambda *args: stamps.append(clock(model.device)))
    try:
        yield stamps, others
    finally:
        handle.remove()
        after, seconds = others_jiffies(), time.perf_counter() - start
        if None not in (before, after) and seconds >= 1:   # shorter blocks are below the clock tick's resolution
            others[0] = max(0.0, (after - before) / (os.sysconf("SC_CLK_TCK") * seconds))   # / one core's jiffies


@contextmanager
def eviction_clock():
    """Seconds spent choosing, inside the block: `kvcache.compress` (score + keep), `Layer.remember` (window
    queries) and, for block top-k, `kvcache.page_plan` and `kvcache.top_pages` (page scores at every decode step).
    Each call reads the synchronised clock of its first argument's device (a Layer's, or page counts')."""
    spent = [0.0]

    def clocked(fn):
        def wrapper(*args, **kwargs):
            device = args[0].device if torch.is_tensor(args[0]) else args[0].k_buf.device
            seconds, result = timed(lambda: fn(*args, **kwargs), device)
            spent[0] += seconds
            return result
        return wrapper
    wrapped = {name: clocked(getattr(kvcache, name)) for name in ("compress", "page_plan", "top_pages")}
    with patch.multiple(kvcache, **wrapped), patch.object(kvcache.Layer, "remember", clocked(kvcache.Layer.remember)):
        yield spent   # patch puts each original back when the block ends
