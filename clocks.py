"""How the benches time work and attribute the time (to a call, to choosing what to keep, to other processes),
and read a run's peak GPU memory.

Every clock here reads `sampler.clock(device)`, which on a GPU synchronises first: CUDA runs kernels
asynchronously, so an unsynchronised clock times their launch, not the work. Timings are measurements, never
assertions: the tests check only how the clocks count, on fake clocks, never a speed.
- `timed` / `rate`: one call's seconds; work per second, the median of repeated calls after a warm-up call.
  `copy_bandwidth` is such a rate: bytes per second of a tensor copy, the memory bound the benches compare with.
- `run_clocks`: a stamp at every forward pass, and how many cores other processes kept busy meanwhile
  (`others_jiffies`, from Linux's /proc): a disturbed run is listed, not trusted.
- `eviction_clock`: the seconds spent choosing (what to evict, or which pages) inside a rollout.
- `forward_calls`: an action (a clock's start) at one forward pass of a rollout; `reset_peak` / `peak_bytes`:
  the most GPU memory a run held (bench_gpu.py's decode windows and batch search).

bench.py times its CPU runs with all but the last (`bench.run`, `overheads`, `limit`); bench_gpu.py times
re-scoring with `timed`, the card's bandwidth with `copy_bandwidth`, and its decode windows on `sampler.clock`
itself, started by `forward_calls` (a stamp at every step would synchronise, stalling the queue):

    with eviction_clock() as spent, run_clocks(model) as (stamps, others):
        seconds, out = timed(lambda: generate(model, prompts, sparse, max_new_tokens=64), model.device)
"""
import gc
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


@contextmanager
def forward_calls(model, at, action, hf=False):
    """Run `action()` before forward pass number `at` inside the block (0: the first prefill), to start a clock
    mid-rollout without a stamp (a synchronisation) at every pass. Our sampler's passes are counted at
    `KVCache.start_step`, which announces every pass, also those that a CUDA graph replays without calling the
    model (captured=True); HF generate's (`hf=True`) at the model's forward."""
    count = [0]

    def hook(*args):
        if count[0] == at:
            action()
        count[0] += 1
    start_step = kvcache.KVCache.start_step
    if hf:
        handle = model.register_forward_pre_hook(hook)
        try:
            yield
        finally:
            handle.remove()
    else:
        announced = lambda cache, positions: hook() or start_step(cache, positions)
        with patch.object(kvcache.KVCache, "start_step", announced):
            yield


def reset_peak(device):
    """Forget the allocator's peak (CUDA only), after returning what the last run left cached."""
    if device.type == "cuda":
        gc.collect()   # a failed try's tensors may sit in reference cycles (its frames)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device):
    """`torch.cuda.max_memory_allocated` since `reset_peak`; None on a CPU, which keeps no such count."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
