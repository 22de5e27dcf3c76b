"""The static-shape decode step (static.py) against today's eager path, Hugging Face, a masked dense pass
and torch.multinomial; and proof that the step traces whole (torch.compile, fullgraph) and, run as it is,
never reads a device value on the host (what a CUDA graph cannot capture)."""
import gc

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import distill
import kvcache
import sampler
from kvcache import KVCache, SparseConfig
from schedule import Schedule
from reference import HostReads, hf_greedy, masked_dense_logprobs, tiny_model
from sampler import generate, sample_token
from static import GCClock, OpCounter, StaticCache, ops_per_step, split_mean, step_times

PROMPTS = [[5, 9, 3, 7, 1, 12, 33, 8, 2], [4, 17, 6], [21, 22, 23, 24, 25, 26]]   # ragged: left-padded
CONFIGS = [SparseConfig("full"), *(SparseConfig(p, budget=8, interval=3, window=2, sink=2, kernel=3)
                                   for p in ("streaming", "h2o", "snapkv", "rkv", "random")),
           SparseConfig("blocktopk", budget=4, page_size=4, dense_layers=1)]


def step_kinds(monkeypatch, spans=None):
    """Record, for every decode step of a captured run, whether it ran static or eager (a compression),
    and in `spans` the slots each static step read."""
    kinds = []
    start_step = StaticCache.start_step

    def recorded(cache, positions):
        start_step(cache, positions)
        if cache.decoding:
            kinds.append("static" if cache.static else "eager")
            if cache.static and spans is not None:
                spans.append(cache.span)
    monkeypatch.setattr(StaticCache, "start_step", recorded)
    return kinds


def kept_sets(rollouts):
    """Per layer, step, row and KV head: the positions attended, sorted (-1 slots dropped; a position that
    shows twice counts twice, as it does in `attended_tokens`)."""
    return [[[[sorted(h[h >= 0].tolist()) for h in row] for row in step] for step in layer] for layer in rollouts.kept]


def test_sample_token_draws_what_torch_multinomial_draws():
    # the noise drawn from a seeded generator picks the token torch.multinomial picks from the same generator,
    # also where some tokens have probability 0 (as after top-p)
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    logits[:, 10:50] = float("-inf")
    logp = logits.log_softmax(-1)
    theirs, ours = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    for _ in range(200):
        expected = torch.multinomial(logp.exp(), 1, generator=theirs).squeeze(-1)
        noise = torch.empty_like(logp).exponential_(generator=ours)
        assert torch.equal(sample_token(logp, 1.0, 1.0, noise), expected)


@pytest.mark.parametrize("temperature, top_p", [(0, 1.0), (1.0, 0.9)], ids=["greedy", "seeded-sample"])
@pytest.mark.parametrize("sparse", CONFIGS, ids=lambda s: s.policy)
def test_static_path_equals_the_eager_path(monkeypatch, sparse, temperature, top_p):
    # ragged prompts, rows ending at different steps (EOS = a token row 0 emits early), every policy: the
    # same tokens, log-probs to fp32 rounding, and the same positions kept at every step of every layer
    model = tiny_model("llama")
    eos = generate(model, PROMPTS, sparse, max_new_tokens=30, temperature=0).tokens[0, 6].item()
    run = lambda captured: generate(model, PROMPTS, sparse, max_new_tokens=30, temperature=temperature, top_p=top_p,
                                    eos_token_id=eos, seed=3, record=True, captured=captured)
    eager = run(False)
    monkeypatch.setattr("static.SPAN", 3)                     # several spans, even in an eviction buffer of 11
    spans = []
    kinds = step_kinds(monkeypatch, spans)
    static = run(True)
    assert torch.equal(static.tokens, eager.tokens) and torch.equal(static.mask, eager.mask)
    assert (static.logprobs - eager.logprobs).abs().max() < 1e-5
    assert (static.topk_logprobs - eager.topk_logprobs).abs().max() < 1e-5 and torch.equal(static.topk_ids, eager.topk_ids)
    assert kept_sets(static) == kept_sets(eager)
    assert static.stats["compressions"] == eager.stats["compressions"] == kinds.count("eager")
    assert kinds.count("static") >= 10
    if sparse.policy not in ("full", "blocktopk"):          # a static step right after a compression
        assert any(a == "eager" and b == "static" for a, b in zip(kinds, kinds[1:]))
    if temperature == 0:
        assert len(set(eager.mask.sum(1).tolist())) > 1       # the rows ended at different steps
    assert len(set(spans)) > 1                                 # the test crossed from one span to the next


@pytest.mark.parametrize("interval, lengths, peak", [(4, (11, 12, 14, 3), 15), (1, (6, 3), 9)],
                         ids=["boundaries", "interval-1"])
@pytest.mark.parametrize("policy", ["streaming", "h2o", "snapkv", "rkv", "random"])
def test_static_path_equals_the_eager_path_at_the_budgets_boundaries(monkeypatch, policy, interval, lengths, peak):
    # budget 8, interval 4: prompts of budget + interval - 1 (due at its first decode step), budget + interval and
    # budget + interval + 2 (kept whole past budget + interval: the buffer is prompt + 1 slots), and 3 (far below);
    # interval 1: static steps until the first row passes the budget, then every step compresses (eager)
    model = tiny_model("llama")
    prompts = [list(range(i + 1, i + 1 + n)) for i, n in enumerate(lengths)]
    sparse = SparseConfig(policy, budget=8, interval=interval, window=3, sink=2, kernel=3)
    run = lambda captured: generate(model, prompts, sparse, max_new_tokens=16, temperature=0, record=True,
                                    captured=captured)
    eager = run(False)
    monkeypatch.setattr("static.SPAN", 4)
    kinds = step_kinds(monkeypatch)
    static = run(True)
    assert torch.equal(static.tokens, eager.tokens)
    assert (static.logprobs - eager.logprobs).abs().max() < 1e-5
    assert kept_sets(static) == kept_sets(eager)
    assert kinds.count("static") >= 2 and kinds.count("eager") >= 4
    assert static.stats["peak_kv_tokens"] == eager.stats["peak_kv_tokens"] == peak


def test_h2o_static_steps_accumulate_what_eager_steps_accumulate(monkeypatch):
    # H2O's score, the attention each held key has received (the mean over its KV head's group of query heads),
    # is added to at every step: after 30 steps, static ones between compressions, the static cache holds the
    # eager cache's positions [N, H_kv, S] with the eager cache's accumulated attention, to fp32 rounding
    model = tiny_model("llama")
    monkeypatch.setattr("static.SPAN", 3)
    run = lambda captured: generate(model, PROMPTS, SparseConfig("h2o", budget=8, interval=3, window=2),
                                    max_new_tokens=30, temperature=0, record=True, captured=captured).stats["cache"]
    eager, static = run(False), run(True)
    for ours, theirs in zip(static.layers, eager.layers):
        assert torch.equal(ours.pos, theirs.pos) and theirs.acc.sum() > 1.0
        assert (ours.acc - theirs.acc).abs().max() < 1e-5


def test_a_span_reads_the_held_slots_rounded_up(monkeypatch):
    # a dense buffer of 9 + 30 = 39 slots, SPAN 10: a step holding s slots after its write reads
    # ceil(s / 10) * 10 of them (39 at most), never fewer than it holds
    monkeypatch.setattr("static.SPAN", 10)
    spans = []
    step_kinds(monkeypatch, spans)
    out = generate(tiny_model("llama"), PROMPTS, SparseConfig("full"), max_new_tokens=30, temperature=0, captured=True)
    held = range(10, 10 + len(spans))                        # 9 prompt slots + the step's own key, step 1 on
    assert spans == [min(39, -(-s // 10) * 10) for s in held] and out.tokens.shape[1] == 30


def test_block_top_k_over_budget_for_its_buffer_attends_every_token_as_dense_decoding_does():
    """`k_pages`, the ranks a static block top-k step gathers, is the budget's pages + the reserved ones, but no
    more than the buffer's pages: (slots - 1) // page_size + 1. Here the buffer (9 + 10 = 19 slots) has 5 pages
    and the budget 16 // 4 + 3 reserved would take 7, so every page is attended and the rollout is dense
    decoding's (eager `full`); a bound one page short (slots // page_size, 4 here) drops the longest row's fifth
    page once its context reaches position 16 (the last two steps)."""
    model = tiny_model("llama")
    run = lambda sparse, captured: generate(model, PROMPTS, sparse, max_new_tokens=10, temperature=0,
                                            captured=captured)
    dense = run(SparseConfig("full"), False)
    static = run(SparseConfig("blocktopk", budget=16, page_size=4, dense_layers=1), True)
    assert torch.equal(static.tokens, dense.tokens)
    assert (static.logprobs - dense.logprobs).abs().max() < 1e-5


@pytest.mark.parametrize("schedule", [Schedule((0, 14), (4, 12)), Schedule((0, 14), (4, None))],
                         ids=["growing", "then-dense"])
def test_scheduled_block_top_k_gathers_the_pages_of_its_largest_budget(schedule):
    """With a schedule the budget grows with the context, but `k_pages` is fixed when the static state is made
    (after the prefill, at budget 4): it must come from the largest budget the schedule can reach (None, dense:
    every page of the buffer), not the smallest, nor read None as 0. Past context 14 a row attends 12 // 4 + 3
    pages (or all it holds), which a bound from budget 4 (4 pages) would cut: the static rollout must equal the
    eager one, which asks for its pages afresh at every step."""
    model = tiny_model("llama")
    sparse = SparseConfig("blocktopk", budget=4, page_size=4, dense_layers=1, schedule=schedule)
    run = lambda captured: generate(model, PROMPTS, sparse, max_new_tokens=30, temperature=0, record=True,
                                    captured=captured)
    eager, static = run(False), run(True)
    assert torch.equal(static.tokens, eager.tokens)
    assert (static.logprobs - eager.logprobs).abs().max() < 1e-5
    assert kept_sets(static) == kept_sets(eager)
    assert max(eager.stats["cache"].attended_tokens) > 4 * 4 + 1     # more than budget 4's pages were attended


def test_static_dense_greedy_equals_hugging_face():
    model = tiny_model("qwen3")
    out = generate(model, PROMPTS, SparseConfig("full"), max_new_tokens=24, temperature=0, captured=True)
    assert torch.equal(out.tokens, hf_greedy(model, PROMPTS, 24))


@pytest.mark.parametrize("sparse", CONFIGS[1:], ids=lambda s: s.policy)
def test_static_eviction_equals_masking(sparse):
    # what the static path recorded as attended is what it attended: a dense pass under that mask agrees,
    # and so does DistillSparse's sparse training forward, which reads it from `kept` (--distill)
    model = tiny_model("llama")
    out = generate(model, PROMPTS, sparse, max_new_tokens=30, temperature=1.0, seed=3, record=True, captured=True)
    assert (out.logprobs - masked_dense_logprobs(model, out)).abs().max() < 1e-4
    assert (distill.sparse_logprobs(model, out).detach() - out.logprobs).abs().max() < 1e-4


@pytest.mark.parametrize("sparse", [CONFIGS[0], CONFIGS[4], CONFIGS[-1]], ids=lambda s: s.policy)
def test_the_static_path_runs_under_bf16_autocast(sparse):
    # train.py --dtype bfloat16 --captured: fp32 weights under autocast give fp32 keys (rotary) and bf16 values;
    # the static step stores both in the cache's buffers as the eager one does, and samples the same tokens
    model = tiny_model("llama")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        run = lambda captured: generate(model, PROMPTS, sparse, max_new_tokens=20, temperature=0, captured=captured)
        eager, static = run(False), run(True)
    assert torch.equal(static.tokens, eager.tokens)
    assert (static.logprobs - eager.logprobs).abs().max() < 1e-2


def test_a_seeded_static_sample_is_reproducible():
    model = tiny_model("llama")
    run = lambda seed: generate(model, PROMPTS, SparseConfig("snapkv", budget=8, interval=3, window=2, sink=2),
                                max_new_tokens=20, seed=seed, captured=True).tokens
    assert torch.equal(run(1), run(1)) and not torch.equal(run(1), run(2))


@pytest.mark.parametrize("arch, sparse", [("llama", s) for s in CONFIGS] + [
    ("qwen3", CONFIGS[4]), ("mistral", CONFIGS[0]), ("mistral", CONFIGS[4])], ids=lambda x: getattr(x, "policy", x))
def test_the_static_step_traces_whole(monkeypatch, arch, sparse):
    # torch.compile(fullgraph=True) raises at any graph break; one compiled frame per span over every static
    # step (including those right after a compression) means nothing else in the step depends on a host value
    model = tiny_model(arch, **({"sliding_window": 12} if arch == "mistral" else {}))
    monkeypatch.setattr("static.SPAN", 13)            # dynamo compiles once per span (a guard on the int)
    counter = CompileCounter()                          # the "eager" backend, counting what it compiles
    torch._dynamo.reset()
    capture = sampler.capture
    monkeypatch.setattr(sampler, "capture", lambda step, cache: capture(
        torch.compile(step, fullgraph=True, dynamic=False, backend=counter), cache))
    spans = []
    kinds = step_kinds(monkeypatch, spans)
    traced = generate(model, PROMPTS, sparse, max_new_tokens=30, temperature=1.0, seed=3, record=True, captured=True)
    monkeypatch.undo()
    eager = generate(model, PROMPTS, sparse, max_new_tokens=30, temperature=1.0, seed=3)
    assert counter.frame_count == len(set(spans)) and counter.op_count > 100 * counter.frame_count
    assert kinds.count("static") >= 10
    assert torch.equal(traced.tokens, eager.tokens)
    assert (traced.logprobs - eager.logprobs).abs().max() < 1e-5


@pytest.mark.parametrize("arch, sparse", [("llama", CONFIGS[-1]), ("mistral", CONFIGS[0]), ("mistral", CONFIGS[3])],
                         ids=["blocktopk", "mistral-full", "mistral-snapkv"])
def test_a_static_step_reads_the_steps_inputs_only_from_its_own_device_tensors(monkeypatch, arch, sparse):
    """A CUDA graph replays the tensors it was captured with: `start_step`'s fresh per-step tensors, the positions
    (`step_pos`) and block top-k's pages per row (`top`), are gone (their memory reused) by the time a replay
    runs, so the step must read their copies, `now` and `pages`. Emulated on the CPU: after each static step's
    `start_step`, the fresh tensors are overwritten with garbage (positions -1: padding; 0 pages); the rollout must
    still be the eager one. A step reading `top` attends no page; one reading `step_pos` loses Mistral's sliding
    window (a padding query sees every slot)."""
    model = tiny_model(arch, **({"sliding_window": 12} if arch == "mistral" else {}))
    eager = generate(model, PROMPTS, sparse, max_new_tokens=30, temperature=0)
    start_step, poisoned = StaticCache.start_step, []

    def stale(cache, positions):
        start_step(cache, positions)
        if cache.static:
            cache.step_pos = torch.full_like(cache.step_pos, -1)
            if sparse.policy == "blocktopk":
                cache.top = torch.zeros_like(cache.top)
            poisoned.append(1)
    monkeypatch.setattr(StaticCache, "start_step", stale)
    static = generate(model, PROMPTS, sparse, max_new_tokens=30, temperature=0, captured=True)
    assert len(poisoned) >= 10
    assert torch.equal(static.tokens, eager.tokens)
    assert (static.logprobs - eager.logprobs).abs().max() < 1e-5


def test_host_reads_sees_what_a_capture_refuses():
    x = torch.randn(6)
    with HostReads() as reads:
        x.sum().item(), bool(x.max() > 0), torch.tensor([1, 2]), x[x > 0], x.nonzero(), torch.equal(x, x), x.tolist()
        x.softmax(-1).topk(3), torch.arange(4) + x[:4], x.index_select(0, torch.arange(2)), x[:2].fill_(0)
        x[2:4] = 0.0
    assert reads.seen == ["aten::_local_scalar_dense"] * 2 + ["aten::lift_fresh", "aten::index.Tensor",
                                                              "aten::nonzero", "aten::equal", "tolist"]


@pytest.mark.parametrize("arch, sparse, record", [("llama", s, False) for s in CONFIGS] + [
    ("llama", CONFIGS[3], True), ("llama", CONFIGS[-1], True), ("qwen3", CONFIGS[4], False),
    ("mistral", CONFIGS[0], False)], ids=lambda x: getattr(x, "policy", x))
def test_the_static_step_never_reads_the_device_on_the_host(monkeypatch, arch, sparse, record):
    # run as it is (what the CPU does), every static step, model and sampling included, under HostReads (the
    # eager steps between them, prefill and compressions: tests/test_sampler.py)
    model = tiny_model(arch, **({"sliding_window": 12} if arch == "mistral" else {}))
    reads, capture = HostReads(), sampler.capture
    monkeypatch.setattr(sampler, "capture", lambda step, cache: capture(reads.watch(step), cache))
    generate(model, PROMPTS, sparse, max_new_tokens=30, temperature=1.0, top_p=0.9, seed=3, record=record,
             captured=True)
    assert reads.calls >= 10 and reads.seen == []


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


def test_profile_counts_each_kernels_time_once(monkeypatch, capsys):
    """--profile's device kernels a step: the profiler gives a kernel's time a row of its own and again in the row
    of the op that launched it (as CUDA's profile does: aten::mm's Self CUDA = its kernels'). By hand, 4 steps: a
    6 ms matrix product and a 2 ms copy, 8 ms over 4 steps = 2.0 ms a step (every row summed: 4.0), and 8 launches,
    2 a step: 4 by the runtime's cudaLaunchKernel, 3 by the driver's cuLaunchKernelEx (cuBLAS may call it), a graph."""
    import sampler
    import static
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import EventList, FunctionEvent

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

    class Profile:
        def __init__(self, activities):
            pass
        __enter__ = lambda self: self
        __exit__ = lambda self, *exc: None

        def key_averages(self):
            events = EventList(rows(), use_device="cuda")
            events._build_tree()     # as the profiler does: the ops' parents and children, from their times
            return events.key_averages()
    monkeypatch.setattr(sampler, "generate", rollout)
    monkeypatch.setattr(torch.profiler, "profile", Profile)
    model = type("M", (), dict(device=torch.device("cpu")))()
    static.profile(model, [[1, 2]], SparseConfig("full"), 4)
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
    import static
    times = iter([1.0, 1.5, 4.0, 4.25, 10.0, 10.5])
    monkeypatch.setattr(static, "time", type("T", (), dict(perf_counter=staticmethod(lambda: next(times)))))
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
    monkeypatch.setattr(sampler, "clock", clock)
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
    monkeypatch.setattr(sampler, "generate", broken)
    with pytest.raises(RuntimeError, match="mid-rollout"):
        step_times(tiny_model(), [[5, 9, 3, 7, 1, 12]], sparse, 3)
    assert KVCache.start_step is before


def test_print_step_times_reports_every_rounds_steps_by_hand(monkeypatch, capsys):
    """--step-times with `step_times` replaced by fixed timings (ms): full's steps all 10 in round 1, all 50 in
    round 2 (median 30 over both); snapkv's steady steps 1, 2, ..., 20 and two compressions, 50 and 70, in each of
    2 rounds (the warm-up's 1000s must not count). By hand, snapkv: steady median 10.5, compressions
    (39.5 + 59.5) / 22 = 4.5 a step, spread 0, mean 15 = 0.50x full's, steady 0.35x full's; 4 compressing steps,
    median 60; over the 40 steady steps, p90 the 37th smallest (19), max 20. The policies take turns, round
    after round, after one warm-up each."""
    import argparse

    import static
    calls = []

    def timings(model, prompts, sparse, steps):
        calls.append((sparse.policy, steps))
        if steps == 8:                                                    # the warm-up
            return [1.0] * 3, [False] * 3
        if sparse.policy == "full":
            return [0.040 * calls.count(("full", 22)) - 0.030] * 22, [False] * 22
        return [k / 1e3 for k in range(1, 21)] + [0.050, 0.070], [False] * 20 + [True] * 2
    monkeypatch.setattr(static, "step_times", timings)
    args = argparse.Namespace(shape="bench", batch=2, prompt=6, new=22, budget=16, interval=4, rounds=2)
    sparse = {p: SparseConfig(p, budget=16, interval=4) for p in ("full", "snapkv")}
    static.print_step_times(type("M", (), dict(dtype=torch.float32, device="cpu"))(), [[1, 2]], sparse, args)
    out = capsys.readouterr().out
    assert calls == [("full", 8), ("snapkv", 8)] + [("full", 22), ("snapkv", 22)] * 2
    assert ("      full: mean step  30.00 (1.00x full's) = steady median  30.00 (1.00x) + compressions  0.00 (0 steps, "
            "median    0.00) + the steady steps' spread  0.00 (p90  50.00, max   50.00)") in out
    assert ("    snapkv: mean step  15.00 (0.50x full's) = steady median  10.50 (0.35x) + compressions  4.50 (4 steps, "
            "median   60.00) + the steady steps' spread  0.00 (p90  19.00, max   20.00)") in out


def test_print_step_times_reports_the_rollouts_finished_before_a_time_limits_sigint(monkeypatch, capsys):
    """gpu_check.sh gives --step-times what is left of its call, then SIGINT: the policies whose rollouts finished
    are still reported (here full and snapkv, h2o's rollout interrupted), not a traceback alone; interrupted
    before any finished, the KeyboardInterrupt goes on."""
    import argparse

    import static

    def timings(model, prompts, sparse, steps):
        if steps == 22 and sparse.policy == "h2o":
            raise KeyboardInterrupt
        return [0.010] * 3, [False] * 3
    monkeypatch.setattr(static, "step_times", timings)
    args = argparse.Namespace(shape="bench", batch=2, prompt=6, new=22, budget=16, interval=4, rounds=1)
    sparse = {p: SparseConfig(p, budget=16, interval=4) for p in ("full", "snapkv", "h2o")}
    model = type("M", (), dict(dtype=torch.float32, device="cpu"))()
    static.print_step_times(model, [[1, 2]], sparse, args)
    out = capsys.readouterr().out
    assert "interrupted" in out and "full: mean step" in out and "snapkv: mean step" in out
    assert "h2o: mean step" not in out
    with pytest.raises(KeyboardInterrupt):
        static.print_step_times(model, [[1, 2]], {"h2o": sparse["h2o"]}, args)


@pytest.mark.parametrize("name", ["batch", "prompt", "new", "budget", "interval", "rounds"])
def test_the_command_line_refuses_every_count_below_one_before_building_a_model(monkeypatch, capsys, name):
    # each of these counts at 0 would fail, or time nothing (no round: a median of nothing), only after a model of
    # up to 2B parameters was built: each must be refused first, by name (the test above tries --batch alone)
    import transformers

    import static
    monkeypatch.setattr(transformers, "LlamaForCausalLM", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(SystemExit):
        static.main([f"--{name}", "0"])
    assert f"--{name} must be >= 1, got 0" in capsys.readouterr().err


def test_a_budget_or_interval_up_to_dense_passes_the_checks(monkeypatch):
    # SparseConfig takes budgets up to DENSE = 2**40 (never evicts): the 2**31 bound is for sizes torch allocates
    import transformers

    import static
    monkeypatch.setattr(transformers, "LlamaForCausalLM", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(pytest.fail.Exception, match="a model was built"):
        static.main(["--budget", str(2 ** 40), "--interval", str(2 ** 35), "--policies", "snapkv,blocktopk"])
    with pytest.raises(pytest.fail.Exception, match="a model was built"):   # holds budget + interval, any --new
        static.main(["--new", "2000000000", "--policies", "snapkv,h2o"])
    with pytest.raises(pytest.fail.Exception, match="a model was built"):   # DENSE never compresses: none to wait for
        static.main(["--count-ops", "--budget", str(2 ** 40), "--policies", "snapkv"])


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
])
def test_the_command_line_refuses_bad_flags_before_building_a_model(monkeypatch, capsys, argv, message):
    import transformers

    import static
    monkeypatch.setattr(transformers, "LlamaForCausalLM", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(SystemExit):
        static.main(argv)
    assert message in capsys.readouterr().err


def test_the_command_line_times_each_policy_at_its_budget_and_interval(monkeypatch):
    # Pins main's SparseConfigs, built once from the flags: --count-ops runs each policy, eager then static, at
    # --budget 24 and --interval 4 (not SparseConfig's defaults 512 and 128)
    import static
    seen = []
    monkeypatch.setattr(static, "ops_per_step", lambda model, prompts, sparse, captured: seen.append(sparse) or 1.0)
    static.main(["--shape", "layers28", "--count-ops", "--batch", "1", "--prompt", "4", "--new", "8",
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
    import transformers

    import static

    class Built(Exception):
        pass

    def config(**kwargs):
        raise Built(kwargs["max_position_embeddings"])
    monkeypatch.setattr(transformers, "LlamaConfig", config)
    with pytest.raises(Built) as built:
        static.main(argv)
    assert built.value.args[0] >= positions
