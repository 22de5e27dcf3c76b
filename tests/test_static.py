"""The static-shape decode step (static.py) against today's eager path, Hugging Face, a masked dense pass
and torch.multinomial; and proof that the step traces whole (torch.compile, fullgraph) and, run as it is,
never reads a device value on the host (what a CUDA graph cannot capture). Its bench: test_bench_static.py."""
import pytest
import torch
from torch._dynamo.testing import CompileCounter

import distill
import hook
import sampler
from kvcache import SparseConfig
from schedule import Schedule
from reference import HostReads, caches_passed, hf_greedy, masked_dense_logprobs, tiny_model
from sampler import generate, sample_token
from static import StaticCache

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
    shows twice counts twice)."""
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
    caches = caches_passed(model)
    for captured in (False, True):
        generate(model, PROMPTS, SparseConfig("h2o", budget=8, interval=3, window=2), max_new_tokens=30,
                 temperature=0, captured=captured)
    eager, static = caches[0], caches[-1]
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


@pytest.mark.parametrize("policy", ["full", "blocktopk", "snapkv"])
def test_a_static_step_past_max_new_tokens_is_refused_by_name(policy):
    """As the eager cache's (tests/test_kvcache.py): the buffers hold the prompt + max_new_tokens (here 9 + 3 = 12
    slots; snapkv's budget is past them), and a caller who announces one decode step more is told so by name,
    before the step runs. The static step writes at `cursor` unchecked: the fourth step was torch's
    "index_copy_(): index 12 is out of bounds" (on a GPU, a device-side assert that ends the process's CUDA)."""
    model = tiny_model("llama")
    sparse = SparseConfig(policy, budget=64, interval=4, page_size=4, dense_layers=1)
    cache, prompt = StaticCache(sparse, model.config.num_hidden_layers, max_new_tokens=3), torch.tensor([PROMPTS[0]])
    with hook.sparse_attention(model), torch.no_grad():
        cache.start_step(torch.arange(9)[None])
        sampler.forward(model, prompt, torch.arange(9)[None], cache)
        for p in (9, 10, 11):
            cache.start_step(torch.tensor([[p]]))
            assert cache.static
            sampler.forward(model, prompt[:, :1], torch.tensor([[p]]), cache)
            cache.end_step()
        with pytest.raises(ValueError, match=r"^12 slots held \+ 1 new tokens do not fit the 12 allocated for the "
                                             "cache's max_new_tokens: announce no more steps than it was made for"):
            cache.start_step(torch.tensor([[12]]))
    assert cache.layers[0].size == 12


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
    assert (eager.kept[1] >= 0).sum(-1).max() > 4 * 4 + 1           # the paged layer attended more than budget 4's


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


def test_the_device_state_is_made_once_and_kept_through_the_compressions(monkeypatch):
    """A CUDA graph replays the tensors it was captured with: `cursor`, `ring`, `now`, `pages` and, with record=True,
    `seen` are made once, after the prefill, and every later static step, also one right after a compression's
    `resume`, must find the same tensors, set in place. A resume that made them afresh would leave the graphs writing
    keys at a stale cursor and remembering queries at a stale ring slot; on a CPU, which runs the step as it is, the
    rollout would not show it, so the tensors' identity is pinned here."""
    model = tiny_model("llama")
    start_step, held = StaticCache.start_step, []

    def watched(cache, positions):
        start_step(cache, positions)
        if cache.static:
            held.append([cache.cursor, cache.ring, cache.now, cache.pages, *cache.seen])
    monkeypatch.setattr(StaticCache, "start_step", watched)
    kinds = step_kinds(monkeypatch)
    generate(model, PROMPTS, CONFIGS[3], max_new_tokens=30, temperature=0, record=True, captured=True)
    assert any(a == "eager" and b == "static" for a, b in zip(kinds, kinds[1:]))     # a resume after a compression
    assert len(held) >= 10 and all(all(a is b for a, b in zip(step, held[0])) for step in held)


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
