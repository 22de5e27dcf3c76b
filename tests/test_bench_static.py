"""bench_static.py: the op counter, ops a step, every step's time and its split, the profile's sums and the command
line's checks, against hand counts, a fake clock and step-by-step counts in one rollout."""
import argparse
import gc

import pytest
import torch

import bench_static
import kvcache
from bench_static import GCClock, OpCounter, ops_per_step, split_mean, step_times
from kvcache import KVCache, SparseConfig
from reference import tiny_model
from sampler import generate
from static import StaticCache

PROMPTS = [[5, 9, 3, 7, 1, 12, 33, 8, 2], [4, 17, 6], [21, 22, 23, 24, 25, 26]]   # ragged: left-padded


def test_the_op_counter_counts_launches_not_views():
    x = torch.randn(4, 4)
    with OpCounter() as counter:
        y = x + 1                                  # add
        y.view(16), y.t(), y[1:], y.unsqueeze(0)  # views: no kernel
        y.mul_(2), y.sum()                         # mul_, sum
    assert counter.count == 3


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "static"])
def test_ops_per_step_is_what_each_steady_decode_step_dispatches(monkeypatch, captured):
    """A full cache never compresses: every decode step dispatches the same ops, counted here between the
    cache's announcements of consecutive steps, against `ops_per_step`'s difference of two rollouts."""
    model, sparse = tiny_model(), SparseConfig("full", interval=4)
    marks, start_step = [], StaticCache.start_step if captured else KVCache.start_step

    def marked(cache, positions):
        marks.append(counter.count)
        start_step(cache, positions)
    monkeypatch.setattr(StaticCache if captured else KVCache, "start_step", marked)
    with OpCounter() as counter:
        generate(model, PROMPTS, sparse, max_new_tokens=12, temperature=0, captured=captured)
    steps = [b - a for a, b in zip(marks[2:-1], marks[3:])]        # past the prefill and the first steps
    assert len(set(steps)) == 1
    assert ops_per_step(model, PROMPTS, sparse, captured) == steps[0]


@pytest.mark.parametrize("budget", [8, 16])
@pytest.mark.parametrize("captured", [False, True], ids=["eager", "static"])
def test_ops_per_step_spreads_one_compression_over_its_interval(monkeypatch, captured, budget):
    """Prompts of 2, interval 4: by hand, decode steps budget + 2, + 6, + 10, + 14 compress (2 + step - budget >= 4,
    then every 4), and the steps from budget on repeat with period 4 (a compression, the window's two remembering
    steps, a plain one). `ops_per_step` must be one such period's ops (one compression included) over 4, counted
    here step by step in one rollout; a difference of the 4- and 8-token rollouts would see no compression at all,
    nor, at budget 16, would one of the 8- and 12-token rollouts (the first compression comes at step 18)."""
    model = tiny_model()
    sparse = SparseConfig("snapkv", budget=budget, interval=4, window=2, sink=1, kernel=3)
    prompts = [[5, 9], [4, 17]]
    cls = StaticCache if captured else KVCache
    marks, compressing, start_step = [], [], cls.start_step

    def marked(cache, positions):
        marks.append(counter.count)
        start_step(cache, positions)
        compressing.append(cache.compressing)
    monkeypatch.setattr(cls, "start_step", marked)
    first = budget + 2
    with OpCounter() as counter:
        generate(model, prompts, sparse, max_new_tokens=first + 14, temperature=0, captured=captured)
    monkeypatch.undo()
    steps = [b - a for a, b in zip(marks, marks[1:])]                # steps[d]: decode step d (0: the prefill)
    assert [d for d, c in enumerate(compressing) if c] == [first, first + 4, first + 8, first + 12]
    period = sum(steps[first + 2:first + 6])
    assert sum(steps[first + 6:first + 10]) == period
    assert steps[first + 4] > max(steps[first + 2], steps[first + 3], steps[first + 5])   # first + 4 compresses
    assert ops_per_step(model, prompts, sparse, captured) == period / 4


def fake_profiler(monkeypatch, rows, rollout):
    """torch.profiler.profile replaced by a profiler whose key_averages are the events `rows()` gives, and
    bench_static.generate by `rollout`; -> a model stand-in on the CPU, for bench_static.profile."""
    from torch.autograd.profiler_util import EventList

    class Profile:
        def __init__(self, activities):
            pass
        __enter__ = lambda self: self
        __exit__ = lambda self, *exc: None

        def key_averages(self):
            events = EventList(rows(), use_device="cuda")
            events._build_tree()     # as the profiler does: the ops' parents and children, from their times
            return events.key_averages()
    monkeypatch.setattr(bench_static, "generate", rollout)
    monkeypatch.setattr(torch.profiler, "profile", Profile)
    return type("M", (), dict(device=torch.device("cpu")))()


def test_profile_counts_each_kernels_time_once(monkeypatch, capsys):
    """--profile's device kernels a step: the profiler gives a kernel's time a row of its own and again in the row
    of the op that launched it (as CUDA's profile does: aten::mm's Self CUDA = its kernels'). By hand, 4 steps: a
    6 ms matrix product and a 2 ms copy, 8 ms over 4 steps = 2.0 ms a step (every row summed: 4.0), and 8 launches,
    2 a step: 4 by the runtime's cudaLaunchKernel, 3 by the driver's cuLaunchKernelEx (cuBLAS may call it), a graph."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    def rollout(*args, **kwargs):
        return type("R", (), dict(stats=dict(seconds=0.04)))()
    def rows():   # one after another on the host's clock (the profiler nests an op in one that spans it)
        events = []
        for i, (op, kernel, us) in enumerate([("aten::mm", "nvjet_mm", 6000), ("aten::copy_", "Memcpy HtoD", 2000)]):
            cpu = FunctionEvent(i, op, 0, 10_000 * i, 10_000 * i + us, use_device="cuda", stack=[])
            cpu.append_kernel(kernel, 0, us)
            events += [cpu, FunctionEvent(10 + i, kernel, 0, 10_000 * i, 10_000 * i + us, use_device="cuda",
                                          stack=[], device_type=DeviceType.CUDA)]
        launch = ["cudaLaunchKernel"] * 4 + ["cuLaunchKernelEx"] * 3 + ["cudaGraphLaunch"]   # as CUDA names them
        return events + [FunctionEvent(20 + i, name, 0, 30_000 + 10 * i, 30_005 + 10 * i, use_device="cuda",
                                       stack=[]) for i, name in enumerate(launch)]

    model = fake_profiler(monkeypatch, rows, rollout)
    bench_static.profile(model, [[1, 2]], SparseConfig("full"), 4)
    out = capsys.readouterr().out
    assert "full, eager: 10.0 ms a step under the profiler, device kernels 2.0 ms a step, 2 launches a step" in out


def test_split_mean_parts_the_mean_step_by_hand():
    # steady steps 10, 12, 11, 30 (median 11.5), compressions 50 and 20: (50 - 11.5 + 20 - 11.5) / 6 = 7.83...,
    # the steady steps' excess (-1.5 + 0.5 - 0.5 + 18.5) / 6 = 2.83...; 11.5 + 7.83 + 2.83 = 22.17 = the mean
    seconds, compressing = [10, 50, 12, 11, 20, 30], [False, True, False, False, True, False]
    steady, compressions, spread = split_mean(seconds, compressing)
    assert (steady, compressions, spread) == pytest.approx((11.5, 47 / 6, 17 / 6))
    assert steady + compressions + spread == pytest.approx(sum(seconds) / len(seconds))
    assert split_mean([4, 6], [True, True]) == (0.0, 5.0, 0.0)          # interval 1 over budget: no steady step


def test_gc_clock_counts_the_full_collections_under_it_only():
    clock = GCClock()
    for _ in range(2):           # summed over every `with`
        with clock:
            gc.collect()
            gc.collect(0)
        gc.collect()
    assert clock.full == 2 and clock.seconds > 0


def test_gc_clock_sums_each_collections_start_to_stop_and_counts_generation_2_only(monkeypatch):
    """gc calls its callbacks with ("start", info) and ("stop", info) around each collection. Driven by hand on a
    clock that reads 1, 1.5, 4, 4.25, 10, 10.5: three collections of 0.5, 0.25 and 0.5 s, summed to 1.25 (not
    the last one alone, nor stop-to-start gaps); only the generation-2 one is full (not generation 1)."""
    times = iter([1.0, 1.5, 4.0, 4.25, 10.0, 10.5])
    monkeypatch.setattr(bench_static, "time", type("T", (), dict(perf_counter=staticmethod(lambda: next(times)))))
    clock = GCClock()
    for generation in (1, 2, 0):
        clock.tick("start", {"generation": generation})
        clock.tick("stop", {"generation": generation, "collected": 0, "uncollectable": 0})
    assert clock.seconds == 1.25 and clock.full == 1


@pytest.fixture
def fake_clock(monkeypatch):
    """The synchronised clock `step_times` reads, faked: each read is a second later; -> [now], to move by hand."""
    now = [0.0]

    def clock(device=None):
        now[0] += 1
        return now[0]
    monkeypatch.setattr(bench_static, "clock", clock)
    return now


def test_step_times_gives_each_decode_step_its_own_time_and_marks_its_compressions(monkeypatch, fake_clock):
    """Prompts of 6, budget 4, interval 2: the first decode step holds 7 tokens (3 over: compress to 4), the next
    5, then 6 (2 over: compress), ...: by hand, decode steps 0, 2, 4 and 6 of 8 compress. A compression that takes
    60 s a layer on the fake clock must show in exactly those steps' times (an off-by-one would put it on their
    neighbours)."""
    compress = kvcache.compress

    def slow(*args):
        fake_clock[0] += 60
        return compress(*args)
    monkeypatch.setattr(kvcache, "compress", slow)
    model, sparse = tiny_model(), SparseConfig("snapkv", budget=4, interval=2, window=2, sink=1, kernel=3)
    seconds, compressing = step_times(model, [[5, 9, 3, 7, 1, 12], [4, 17, 6, 8, 2, 11]], sparse, 9)
    assert compressing == [True, False] * 4
    assert [s > 120 for s in seconds] == compressing, seconds          # 2 layers x 60 s


def test_step_times_charges_a_steps_announcement_to_that_step(monkeypatch, fake_clock):
    """A step runs from its own `start_step` (the host's bookkeeping: which rows compress, the copy of their
    arguments) to the next one's: a mark taken after `start_step` would charge a compressing step's bookkeeping
    to the step before it. The compressing steps' `start_step` takes 100 s more on the fake clock, by hand decode
    steps 0, 2, 4, 6 of 8 (as in the test above): it must show in exactly those steps."""
    start_step = KVCache.start_step

    def slow(cache, positions):
        start_step(cache, positions)
        fake_clock[0] += 100 * cache.compressing
    monkeypatch.setattr(KVCache, "start_step", slow)
    model, sparse = tiny_model(), SparseConfig("snapkv", budget=4, interval=2, window=2, sink=1, kernel=3)
    seconds, compressing = step_times(model, [[5, 9, 3, 7, 1, 12], [4, 17, 6, 8, 2, 11]], sparse, 9)
    assert compressing == [True, False] * 4
    assert [s > 100 for s in seconds] == compressing, seconds


def test_step_times_puts_back_the_caches_start_step(monkeypatch, fake_clock):
    # Pins step_times' patch.object: KVCache.start_step is the original again after the rollout, and after one
    # that raises; else every later rollout in the process would keep appending marks
    before, sparse = KVCache.start_step, SparseConfig("snapkv", budget=4, interval=2, window=2, sink=1, kernel=3)
    step_times(tiny_model(), [[5, 9, 3, 7, 1, 12]], sparse, 3)
    assert KVCache.start_step is before

    def broken(*args, **kwargs):
        raise RuntimeError("mid-rollout")
    monkeypatch.setattr(bench_static, "generate", broken)
    with pytest.raises(RuntimeError, match="mid-rollout"):
        step_times(tiny_model(), [[5, 9, 3, 7, 1, 12]], sparse, 3)
    assert KVCache.start_step is before


def printed_step_times(policies, capsys, rounds=2, new=22, interval=4):
    """What `print_step_times` prints over the step_times a test patched in, for `policies` at budget 16 (batch 2,
    prompt 6, a stand-in fp32 CPU model), with the garbage collector off: only the stub's own collections count."""
    args = argparse.Namespace(shape="bench", batch=2, prompt=6, new=new, budget=16, interval=interval, rounds=rounds)
    sparse = {p: SparseConfig(p, budget=16, interval=interval) for p in policies}
    gc.disable()
    try:
        bench_static.print_step_times(type("M", (), dict(dtype=torch.float32, device="cpu"))(), [[1, 2]], sparse, args)
    finally:
        gc.enable()
    return capsys.readouterr().out


def test_print_step_times_reports_every_rounds_steps_by_hand(monkeypatch, capsys):
    """--step-times with `step_times` replaced by fixed timings (ms): full's steps all 10 in round 1, all 50 in
    round 2 (median 30 over both); snapkv's steady steps 1, 2, ..., 20 and two compressions, 50 and 70, in each of
    2 rounds (the warm-up's 1000s must not count). By hand, snapkv: steady median 10.5, compressions
    (39.5 + 59.5) / 22 = 4.5 a step, spread 0, mean 15 = 0.50x full's, steady 0.35x full's; 4 compressing steps,
    median 60; over the 40 steady steps, p90 the nearest rank ceil(0.9 x 40) = 36th smallest (18), max 20. The
    policies take turns, round after round, after one warm-up each."""
    calls = []

    def timings(model, prompts, sparse, steps):
        calls.append((sparse.policy, steps))
        if steps == 8:                                                    # the warm-up
            return [1.0] * 3, [False] * 3
        if sparse.policy == "full":
            return [0.040 * calls.count(("full", 22)) - 0.030] * 22, [False] * 22
        return [k / 1e3 for k in range(1, 21)] + [0.050, 0.070], [False] * 20 + [True] * 2
    monkeypatch.setattr(bench_static, "step_times", timings)
    out = printed_step_times(("full", "snapkv"), capsys)
    assert calls == [("full", 8), ("snapkv", 8)] + [("full", 22), ("snapkv", 22)] * 2
    assert ("      full: mean step  30.00 (1.00x full's) = steady median  30.00 (1.00x) + compressions  0.00 (0 steps, "
            "median    0.00) + the steady steps' spread  0.00 (p90  50.00, max   50.00)") in out
    assert ("    snapkv: mean step  15.00 (0.50x full's) = steady median  10.50 (0.35x) + compressions  4.50 (4 steps, "
            "median   60.00) + the steady steps' spread  0.00 (p90  18.00, max   20.00)") in out


def test_print_step_times_reports_the_rollouts_finished_before_a_time_limits_sigint(monkeypatch, capsys):
    """gpu_check.sh gives --step-times what is left of its call, then SIGINT: the policies whose rollouts finished
    are still reported (here full and snapkv, h2o's rollout interrupted), not a traceback alone; interrupted
    before any finished, the KeyboardInterrupt goes on."""
    def timings(model, prompts, sparse, steps):
        if steps == 22 and sparse.policy == "h2o":
            raise KeyboardInterrupt
        return [0.010] * 3, [False] * 3
    monkeypatch.setattr(bench_static, "step_times", timings)
    out = printed_step_times(("full", "snapkv", "h2o"), capsys, rounds=1)
    assert "interrupted" in out and "full: mean step" in out and "snapkv: mean step" in out
    assert "h2o: mean step" not in out
    with pytest.raises(KeyboardInterrupt):
        printed_step_times(("h2o",), capsys, rounds=1)


def test_print_step_times_counts_no_collection_of_an_interrupted_rollout(monkeypatch, capsys):
    """--rounds 2, SIGINT in h2o's second rollout, after a full collection in it: h2o is reported from its first
    rollout's steps (3 of 10 ms), so its garbage collector's share must be that rollout's too, 0 full collections
    (the collector is off, and no finished rollout collects), not the lost rollout's 1 charged to the steps kept."""
    calls = []

    def timings(model, prompts, sparse, steps):
        calls.append(sparse.policy)
        if steps == 22 and calls.count("h2o") == 3:        # the warm-up, round 1, then round 2's
            gc.collect()
            raise KeyboardInterrupt
        return [0.010] * 3, [False] * 3
    monkeypatch.setattr(bench_static, "step_times", timings)
    h2o = [line for line in printed_step_times(("full", "h2o"), capsys).splitlines() if line.strip().startswith("h2o:")]
    assert len(h2o) == 1 and h2o[0].endswith("garbage collector 0.00 a step, 0 full collections"), h2o


@pytest.mark.parametrize("name", ["batch", "prompt", "new", "budget", "interval", "rounds"])
def test_the_command_line_refuses_every_count_below_one_before_building_a_model(monkeypatch, capsys, name):
    # each of these counts at 0 would fail, or time nothing (no round: a median of nothing), only after a model of
    # up to 2B parameters was built: each must be refused first, by name (the test above tries --batch alone)

    monkeypatch.setattr(bench_static, "LlamaForCausalLM", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(SystemExit):
        bench_static.main([f"--{name}", "0"])
    assert f"--{name} must be >= 1, got 0" in capsys.readouterr().err


def test_a_budget_or_interval_up_to_dense_passes_the_checks(monkeypatch):
    # SparseConfig takes budgets up to DENSE = 2**40 (never evicts): the 2**31 bound is for sizes torch allocates

    monkeypatch.setattr(bench_static, "LlamaForCausalLM", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(pytest.fail.Exception, match="a model was built"):
        bench_static.main(["--budget", str(2 ** 40), "--interval", str(2 ** 35), "--policies", "snapkv,blocktopk"])
    with pytest.raises(pytest.fail.Exception, match="a model was built"):   # holds budget + interval, any --new
        bench_static.main(["--new", "2000000000", "--policies", "snapkv,h2o"])
    with pytest.raises(pytest.fail.Exception, match="a model was built"):   # DENSE never compresses: none to wait for
        bench_static.main(["--count-ops", "--budget", str(2 ** 40), "--policies", "snapkv"])


@pytest.mark.parametrize("argv, message", [
    (["--batch", "0"], "--batch must be >= 1, got 0"),
    (["--profile", "-1"], "--profile must be >= 0 (0: no profile), got -1"),
    (["--policies", "full,xyz"], "unknown policy 'xyz'; allowed: full, streaming"),
    (["--policies", "blocktopk", "--budget", "4"], "budget=4 must be >= page_size = 16"),
    (["--device", "gpu"], "--device 'gpu': give auto, cpu, cuda or cuda:N"),         # was torch's list of backends
    (["--prompt", str(2 ** 63)], f"--prompt must be < 2**31, got {2 ** 63}"),       # was: an OverflowError traceback
    (["--prompt", "2000000000", "--dtype", "float32"], "--batch 8 x --prompt 2000000000 + 512 new tokens: the KV "
     "cache full preallocates (2000000512 slots a row) is 122070 GiB in torch.float32, and this cpu has"),
    # 2 x 8 x 2 x 64 x 8 x 2e9 x 4 B: was a traceback. Full and block top-k preallocate prompt + new slots: a long
    # --new was not checked (it was minutes of swapping once the model was built), an evicting cache's --new is free
    (["--new", "2000000000", "--policies", "snapkv,blocktopk"], "--batch 8 x --prompt 256 + 2000000000 new tokens: "
     "the KV cache blocktopk preallocates (2000000256 slots a row) is 122070 GiB in torch.float32"),
    (["--count-ops", "--step-times"], "runs of their own, each alone: got --count-ops --step-times"),   # one was
    (["--step-times", "--hf"], "runs of their own, each alone: got --step-times --hf"),         # silently dropped
    (["--count-ops", "--profile", "8"], "runs of their own, each alone: got --count-ops --profile"),
    # one token is the prefill's: no decode step, and split_mean's ZeroDivisionError once the model was built
    (["--step-times", "--new", "1"], "--step-times times decode steps, and --new 1 has none: give --new 2 or more"),
    # a 1-token rollout is the prefill alone: its time was printed as "ms a step", with kernels and launches a step
    (["--profile", "1"], "--profile 1 profiles the prefill alone, no decode step: give 0 (no profile) or 2 or more"),
])
def test_the_command_line_refuses_bad_flags_before_building_a_model(monkeypatch, capsys, argv, message):

    monkeypatch.setattr(bench_static, "LlamaForCausalLM", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(SystemExit):
        bench_static.main(argv)
    assert message in capsys.readouterr().err


def test_the_command_line_times_each_policy_at_its_budget_and_interval(monkeypatch):
    # Pins main's SparseConfigs, built once from the flags: --count-ops runs each policy, eager then static, at
    # --budget 24 and --interval 4 (not SparseConfig's defaults 512 and 128)
    seen = []
    monkeypatch.setattr(bench_static, "ops_per_step", lambda model, prompts, sparse, captured: seen.append(sparse) or 1.0)
    bench_static.main(["--shape", "layers28", "--count-ops", "--batch", "1", "--prompt", "4", "--new", "8",
                 "--policies", "snapkv,full", "--budget", "24", "--interval", "4"])
    assert seen == [SparseConfig("snapkv", 24, 4)] * 2 + [SparseConfig("full", 24, 4)] * 2


@pytest.mark.parametrize("argv, positions", [
    (["--prompt", "256", "--new", "512", "--profile", "5000"], 256 + 5000),
    # the warm-up rollouts (8 tokens) beside --new 2: was a traceback after the model was built
    (["--prompt", "4", "--new", "2", "--interval", "1"], 4 + 8),
    # --count-ops past the first compression: at budget 64, prompt 16, interval 8 a 48 + 24-token rollout
    (["--prompt", "16", "--new", "8", "--budget", "64", "--interval", "8", "--policies", "snapkv", "--count-ops"],
     16 + 48 + 24),
], ids=["profile", "warm-up", "count-ops"])
def test_the_model_has_positions_for_every_rollout_it_decodes(monkeypatch, argv, positions):
    # --profile 5000 beside --new 512 was a traceback at the very end, after every timed rollout: "max_new_tokens
    # 5000: ... must fit the model's 897 positions"


    class Built(Exception):
        pass

    def config(**kwargs):
        raise Built(kwargs["max_position_embeddings"])
    monkeypatch.setattr(bench_static, "LlamaConfig", config)
    with pytest.raises(Built) as built:
        bench_static.main(argv)
    assert built.value.args[0] >= positions


def test_profile_runs_eager_then_captured_and_counts_graph_launches_not_annotations(monkeypatch, capsys):
    """Pins profile's two passes and its sums where the first test's rounding hides them. By hand, 2 steps: one
    6 ms kernel -> 3.0 ms a step, not 7.5 with the 9 ms user-annotation range on the device's timeline (a
    `record_function`, no kernel of its own); 2 cudaLaunchKernel + 2 cuLaunchKernelEx + 2 cudaGraphLaunch = 3
    launches a step (2 without the graph's, 2 with the runtime's alone). Each pass warms up then profiles its own
    path: eager twice, then captured twice, each printed under its name (a pass dropped, or `captured` not passed
    on, prints or times one path only)."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    calls = []

    def rollout(model, prompts, sparse, max_new_tokens, temperature, captured):
        calls.append((max_new_tokens, captured))
        return type("R", (), dict(stats=dict(seconds=0.05)))()

    def rows():
        cpu = FunctionEvent(0, "aten::mm", 0, 0, 6000, use_device="cuda", stack=[])
        cpu.append_kernel("nvjet_mm", 0, 6000)
        events = [cpu, FunctionEvent(1, "nvjet_mm", 0, 0, 6000, use_device="cuda", stack=[], device_type=DeviceType.CUDA),
                  FunctionEvent(2, "## forward ##", 0, 20_000, 29_000, use_device="cuda", stack=[],
                                device_type=DeviceType.CUDA, is_user_annotation=True)]
        launch = ["cudaLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch"] * 2
        return events + [FunctionEvent(10 + i, name, 0, 40_000 + 10 * i, 40_005 + 10 * i, use_device="cuda", stack=[])
                         for i, name in enumerate(launch)]

    model = fake_profiler(monkeypatch, rows, rollout)
    bench_static.profile(model, [[1, 2]], SparseConfig("full"), 2)
    out = capsys.readouterr().out
    assert calls == [(2, False), (2, False), (2, True), (2, True)]
    for path in ("eager", "captured"):
        assert f"full, {path}: 25.0 ms a step under the profiler, device kernels 3.0 ms a step, 3 launches a step" in out


def test_counted_steps_wait_for_an_evicting_caches_budget_past_the_prompt_by_hand(monkeypatch):
    # Pins counted_steps and ops_per_step's prompt length: interval 8, budget 64. An evicting cache first compresses
    # once the prompt + its steps pass the budget: prompt 3 -> skip 61, rollouts of 61 + 16 and 61 + 24 tokens
    # (ops_per_step reads the prompt's length, 3, not the batch's 1); prompt 100, past the budget -> no skip (not a
    # negative one); full and block top-k never compress -> 16 and 24 whatever the prompt
    snapkv, interval = SparseConfig("snapkv", budget=64, interval=8), 8
    assert bench_static.counted_steps(snapkv, 3) == (61 + 16, 61 + 24)
    assert bench_static.counted_steps(snapkv, 100) == (16, 24)
    for policy in ("full", "blocktopk"):
        assert bench_static.counted_steps(SparseConfig(policy, budget=64, interval=interval), 3) == (16, 24)
    steps = []
    monkeypatch.setattr(bench_static, "generate", lambda model, prompts, sparse, max_new_tokens, **k: steps.append(max_new_tokens))
    assert ops_per_step(None, [[1, 2, 3]], snapkv, False) == 0 and steps == [77, 85]


def test_step_times_times_the_last_decode_step_to_the_rollouts_end(fake_clock):
    # Pins step_times' last end, a clock read after the rollout: on the fake clock (a second a read) every one of
    # the 4 decode steps of a 5-token rollout takes at least its own mark's second, the last one included (not 0)
    seconds, compressing = step_times(tiny_model(), [[5, 9, 3]], SparseConfig("full"), 5)
    assert len(seconds) == len(compressing) == 4 and min(seconds) >= 1, seconds


def test_print_step_times_splits_a_spread_mean_and_charges_each_rounds_collections_by_hand(monkeypatch, capsys):
    """--rounds 2 on fixed timings (ms), the steady steps spread (the test above has none), a garbage collection of
    4 ms on a faked clock. full: 10, 20, 60 then 10, 20, 90, a full collection in each rollout. By hand: steady median
    20, spread (210 - 6 x 20) / 6 = 15, mean 35; p90 the ceil(0.9 x 6) = 6th smallest, 90 (floor(5.4) = 5th: 60);
    collector 8 ms / 6 steps = 1.33 a step (not over --new, --rounds, nor round 2's alone), 2 full. snapkv: 4, 6, 50c
    then 4, 8, 30c, a generation-0 collection in round 1: median 5, compressions (45 + 25) / 6 = 11.67, spread
    (-1 + 1 - 1 + 3) / 6 = 0.33, mean 17 = 0.49x full's mean 35 (0.85x: its steady median alone); steady 0.25x;
    p90 the 4th of 4 (8, not 6); collector 4 / 6 = 0.67, 0 full."""
    calls = []
    reads = iter(0.004 * k for k in range(1000))          # each read 4 ms on: a collection's start to stop, 4 ms
    monkeypatch.setattr(bench_static, "time", type("T", (), dict(perf_counter=staticmethod(lambda: next(reads)))))

    def timings(model, prompts, sparse, steps):
        calls.append(sparse.policy)
        rounds = calls.count(sparse.policy) - 1            # 0: the warm-up
        if rounds == 0:
            return [1.0] * 3, [False] * 3
        if sparse.policy == "full":
            gc.collect()
            return [0.010, 0.020, [0.060, 0.090][rounds - 1]], [False] * 3
        if rounds == 1:
            gc.collect(0)
        return [0.004, [0.006, 0.008][rounds - 1], [0.050, 0.030][rounds - 1]], [False, False, True]
    monkeypatch.setattr(bench_static, "step_times", timings)
    out = printed_step_times(("full", "snapkv"), capsys)
    assert ("      full: mean step  35.00 (1.00x full's) = steady median  20.00 (1.00x) + compressions  0.00 (0 steps, "
            "median    0.00) + the steady steps' spread 15.00 (p90  90.00, max   90.00); garbage collector 1.33 a step, "
            "2 full collections") in out, out
    assert ("    snapkv: mean step  17.00 (0.49x full's) = steady median   5.00 (0.25x) + compressions 11.67 (2 steps, "
            "median   40.00) + the steady steps' spread  0.33 (p90   8.00, max    8.00); garbage collector 0.67 a step, "
            "0 full collections") in out, out


def test_print_step_times_gives_no_ratio_to_a_first_policy_without_steady_steps(monkeypatch, capsys):
    """--policies snapkv,full at interval 1 over budget: every snapkv step compresses, so its steady median is 0
    (split_mean) and each policy's steady ratio to it is nan, not a ZeroDivisionError at full's line; the mean's
    ratio is still to snapkv's whole mean (5 ms: full's 10 is 2.00x); no steady step: p90 and max 0."""
    def timings(model, prompts, sparse, steps):
        if sparse.policy == "snapkv":
            return [0.004, 0.006], [True, True]
        return [0.010, 0.010], [False, False]
    monkeypatch.setattr(bench_static, "step_times", timings)
    out = printed_step_times(("snapkv", "full"), capsys, rounds=1, new=3, interval=1)
    assert ("    snapkv: mean step   5.00 (1.00x snapkv's) = steady median   0.00 (nanx) + compressions  5.00 (2 steps, "
            "median    5.00) + the steady steps' spread  0.00 (p90   0.00, max    0.00)") in out, out
    assert ("      full: mean step  10.00 (2.00x snapkv's) = steady median  10.00 (nanx) + compressions  0.00 (0 steps, "
            "median    0.00) + the steady steps' spread  0.00 (p90  10.00, max   10.00)") in out, out
