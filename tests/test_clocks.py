"""clocks.py counts as it says: each clock on a fake one (a tick a read, or a clock only the calls advance), a
fake /proc, and kvcache's choosing functions wrapped only inside the block. No timed assertions: speeds differ
between machines and runs."""
import pytest
import torch

import clocks
import sampler
from kvcache import KVCache, SparseConfig
from reference import hf_greedy, tiny_model
from sampler import generate


def test_an_eviction_wrapper_is_removed_after_use():
    names = ("compress", "page_plan", "top_pages")           # block top-k's choice: its shared plan and each layer's
    before = [getattr(clocks.kvcache, name) for name in names]
    with clocks.eviction_clock():
        assert all(getattr(clocks.kvcache, name) is not fn for name, fn in zip(names, before))
    assert all(getattr(clocks.kvcache, name) is fn for name, fn in zip(names, before))


def test_others_jiffies_reads_the_machines_busy_jiffies_less_this_process(monkeypatch):
    # Pins others_jiffies on a fake /proc: the first ("cpu") line, less idle (1000) and iowait (20), less our
    # utime (30) and stime (12), fields 14 and 15 after a command name that holds ")": 1180 - 1020 - 42 = 118
    texts = {"/proc/stat": "cpu  100 5 50 1000 20 3 2 0 0 0\ncpu0 1 1 1 1 1 1 1 1 1 1\n",
             "/proc/self/stat": "42 (a) b) R 1 2 3 4 5 6 7 8 9 10 30 12 99 99 20 0\n"}
    def read_text(self):
        if not texts:
            raise FileNotFoundError(self.path)                          # not Linux: no /proc
        return texts[self.path]
    monkeypatch.setattr(clocks, "Path", lambda path: type("P", (), dict(path=path, read_text=read_text))())
    assert clocks.others_jiffies() == 118
    # a machine that runs virtual machines: the kernel adds their time to user and nice and to guest and guest_nice
    # (proc(5)), so the last two fields are counted already: 60 more in user, 7 more in nice, 60 and 7 in guest
    texts["/proc/stat"] = "cpu  160 12 50 1000 20 3 2 0 60 7\n"
    assert clocks.others_jiffies() == 118 + 60 + 7
    texts.clear()
    assert clocks.others_jiffies() is None


@pytest.mark.parametrize("jiffies, seconds, load", [((1000, 1300), 2.0, "300 / tick / 2"), ((1000, 900), 2.0, 0.0),
                                                    ((1000, 1300), 1.0, "300 / tick"), ((1000, 1300), 0.5, None),
                                                    ((None, 1300), 2.0, None)])
def test_run_clocks_disturbance_is_other_processes_cores_over_the_block(monkeypatch, jiffies, seconds, load):
    # Pins run_clocks: (after - before) / (clock ticks a second x seconds), the cores others kept busy; never below
    # 0; None for a block under 1 s (below the tick's resolution; exactly 1 s is kept: mutant `> 1`) or without /proc
    reads, times = iter(jiffies), iter([0.0, seconds])
    monkeypatch.setattr(clocks, "others_jiffies", lambda: next(reads))
    monkeypatch.setattr(clocks, "time", type("T", (), dict(perf_counter=staticmethod(lambda: next(times)))))
    model = type("M", (), dict(device="cpu", register_forward_pre_hook=lambda self, fn: type(
        "H", (), dict(remove=lambda self: None))()))()
    with clocks.run_clocks(model) as (_, others):
        pass
    tick = clocks.os.sysconf("SC_CLK_TCK")
    expected = {"300 / tick / 2": 300 / tick / 2, "300 / tick": 300 / tick}.get(load, load)
    assert others[0] == expected


def test_copy_bandwidth_counts_the_read_and_the_write_on_one_tick_timings(monkeypatch):
    # Pins copy_bandwidth (read + write: 2 x 4 bytes per fp32 value): on a clock that ticks once a read every
    # timing is 1 s, so the rate is its work
    ticks = iter(range(10 ** 6))
    monkeypatch.setattr(clocks, "clock", lambda device="cpu": float(next(ticks)))
    assert clocks.copy_bandwidth(1000, repeats=2) == 8000.0


def test_timed_and_rate_read_the_clock_around_the_call_and_skip_the_warm_up(monkeypatch):
    # Pins timed (clock read before and after fn, not both before) and rate (one untimed warm-up call, then the
    # median of `repeats` timings) on a clock that only the calls advance, by the "seconds" each one costs
    now = [0.0]
    monkeypatch.setattr(clocks, "clock", lambda device="cpu": now[0])

    def costing(*costs):
        costs = iter(costs)

        def fn():
            now[0] += next(costs)
            return "done"
        return fn
    assert clocks.timed(costing(5.0)) == (5.0, "done")
    assert clocks.rate(6, costing(10.0, 2.0), repeats=1) == 3.0            # the 10 s warm-up is not timed: 6 / 2
    assert clocks.rate(12, costing(0.0, 1.0, 1.0, 4.0), repeats=3) == 12.0  # median 1 s (the mean would be 2)


def test_the_timed_window_counts_the_steps_a_graph_replays(monkeypatch):
    # a CUDA graph replays a step without calling the model: a capture that replays the first static step's
    # output stands in for it here. The window's clock must still start before pass 10, not at the model's 10th call
    def replaying(step, cache):
        first = []

        def run(*args):
            first.append(first[0] if first else step(*args))
            cache.end_step()
            return first[0]
        return run
    monkeypatch.setattr(sampler, "capture", replaying)
    model, prompts = tiny_model("qwen3"), [[1, 2, 3]] * 2
    model_calls, clocked = [], []
    model.register_forward_pre_hook(lambda *args: model_calls.append(1))
    with clocks.forward_calls(model, 10, lambda: clocked.append(len(model_calls))):
        generate(model, prompts, SparseConfig("full"), max_new_tokens=20, temperature=0, captured=True)
    assert clocked == [2] and len(model_calls) == 2          # the prefill and the first static step; 18 replayed


@pytest.mark.parametrize("hf", [False, True])
def test_forward_calls_acts_once_before_the_pass_it_names_then_lets_go(hf):
    model, prompts, calls, acted, start_step = tiny_model(), [[1, 2, 3], [4, 5, 6]], [], [], KVCache.start_step
    run = ((lambda: hf_greedy(model, prompts, max_new_tokens=8)) if hf else
           (lambda: generate(model, prompts, SparseConfig("full"), max_new_tokens=8, temperature=0)))
    with clocks.forward_calls(model, 5, lambda: acted.append(len(calls)), hf=hf):
        model.register_forward_pre_hook(lambda *args: calls.append(1))   # after forward_calls's: it counts first
        run()
        run()                                                 # a second rollout: pass 5 was the first one's
    assert acted == [5]                                       # before the 6th forward: the prefill + 4 decode steps
    assert len(model._forward_pre_hooks) == 1 and KVCache.start_step is start_step   # its hooks are gone


def test_peak_bytes_is_none_on_a_cpu_which_keeps_no_count():
    clocks.reset_peak(torch.device("cpu"))                    # nothing to forget on a CPU: no error
    assert clocks.peak_bytes(torch.device("cpu")) is None


def test_the_clocks_read_the_device_they_are_given_and_count_their_repeats(monkeypatch):
    # Pins timed's, rate's and copy_bandwidth's device (each read of the synchronised clock is the given device's:
    # a CPU clock would time a CUDA kernel's launch, not its work) and their repeats: rate reads the clock twice a
    # timed call and times `repeats` calls, 5 by default, as does copy_bandwidth (mutants: clock("cpu") at the end,
    # the default 3, copy_bandwidth's repeats not passed on). "meta" holds tensors without memory: no copy runs
    reads = []
    monkeypatch.setattr(clocks, "clock", lambda device="cpu": reads.append(device) or float(len(reads)))
    assert clocks.timed(lambda: "done", "cuda:1") == (1.0, "done") and reads == ["cuda:1"] * 2
    for call, device, timings in [(lambda: clocks.rate(6, lambda: None, "cuda:1"), "cuda:1", 5),
                                  (lambda: clocks.rate(6, lambda: None, "cuda:1", repeats=2), "cuda:1", 2),
                                  (lambda: clocks.copy_bandwidth(1000, "meta"), "meta", 5),
                                  (lambda: clocks.copy_bandwidth(1000, "meta", repeats=2), "meta", 2)]:
        reads.clear()
        call()
        assert reads == [device] * (2 * timings)


def test_others_jiffies_is_none_on_a_proc_it_cannot_read(monkeypatch):
    # Pins others_jiffies's None for a /proc/stat that is empty (IndexError) or not numbers (ValueError), as some
    # sandboxes serve it: a run is then listed without its disturbance rather than stopped (mutant: only OSError)
    for stat in ("", "cpu  100 5 x 1000 20 3 2 0 0 0\n"):
        texts = {"/proc/stat": stat, "/proc/self/stat": "42 (a) R 1 2 3 4 5 6 7 8 9 10 30 12 99 99 20 0\n"}
        monkeypatch.setattr(clocks, "Path", lambda path: type("P", (), dict(read_text=lambda self: texts[path]))())
        assert clocks.others_jiffies() is None


def test_run_clocks_stamps_every_forward_pass_inside_the_block_only(monkeypatch):
    # Pins run_clocks's stamps: one read of the model's device's clock before each forward pass in the block, and
    # none after it, its hook removed (mutants: no stamp, the hook left on the model)
    reads = []
    monkeypatch.setattr(clocks, "clock", lambda device="cpu": reads.append(device) or float(len(reads)))
    model, x = torch.nn.Linear(2, 2), torch.zeros(1, 2)
    model.device = "cuda:1"
    with clocks.run_clocks(model) as (stamps, _):
        for _ in range(3):
            model(x)
    model(x)
    assert stamps == [1.0, 2.0, 3.0] and reads == ["cuda:1"] * 3 and not model._forward_pre_hooks


def test_eviction_clock_adds_up_every_choosing_call_on_its_device(monkeypatch):
    # Pins eviction_clock on a clock that ticks once a read, so a timed call costs 1 s: compress, page_plan,
    # top_pages and Layer.remember each add theirs (4 calls: 4 s; mutants: `=` for `+=`, remember unwrapped),
    # on the clock of the first argument's device: a tensor's (page_plan's page counts), else a Layer's k_buf's
    # (mutant: always the CPU's); results and keyword arguments pass through, and nothing counts after the block
    reads = []
    monkeypatch.setattr(clocks, "clock", lambda device="cpu": reads.append(str(device)) or float(len(reads)))
    for name in ("compress", "page_plan", "top_pages"):
        monkeypatch.setattr(clocks.kvcache, name, lambda first, *args, name=name, **kwargs: (name, args, kwargs))
    monkeypatch.setattr(clocks.kvcache.Layer, "remember", lambda self, *args: ("remember", args))
    layer = type("L", (), dict(k_buf=torch.empty(0, device="meta")))()
    with clocks.eviction_clock() as spent:
        assert clocks.kvcache.compress(layer, 1, salt=2) == ("compress", (1,), dict(salt=2))
        assert clocks.kvcache.page_plan(torch.zeros(2, device="meta"), 3) == ("page_plan", (3,), {})
        assert clocks.kvcache.top_pages(layer, 4) == ("top_pages", (4,), {})
        assert clocks.kvcache.Layer.remember(layer, 5) == ("remember", (5,))
    clocks.kvcache.compress(layer)
    assert spent == [4.0] and reads == ["meta"] * 8


def test_reset_peak_and_peak_bytes_on_a_cuda_device(monkeypatch):
    # Pins reset_peak / peak_bytes on a fake CUDA device (the CPU test sees neither): reset_peak collects the
    # cycles, then returns the cache, then forgets the peak of that device (mutants: any one of the three dropped);
    # peak_bytes is the allocated (not reserved) peak of that device
    calls, device = [], type("D", (), dict(type="cuda"))()
    monkeypatch.setattr(clocks, "gc", type("G", (), dict(collect=staticmethod(lambda: calls.append("collect")))))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append(("reset", d)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: calls.append(("allocated", d)) or 123)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: calls.append(("reserved", d)) or 456)
    clocks.reset_peak(device)
    assert calls == ["collect", "empty_cache", ("reset", device)]
    assert clocks.peak_bytes(device) == 123 and calls[-1] == ("allocated", device)
