"""The evictable cache against slow loop-based references, its budget, and its input checks."""
import copy

import pytest
import torch

import kvcache
import static
from hook import sparse_attention
from kvcache import KVCache, SparseConfig
from reference import caches_passed, full_forward_logprobs, masked_dense_logprobs, simulate_cache, tiny_model
from sampler import generate
from schedule import Schedule

B, H, H_KV, D = 3, 4, 2, 8
LENGTHS = (9, 5, 13)   # mixed prompt lengths: the batch is left-padded


def random_steps(prompt_lens=LENGTHS, new_tokens=24, seed=0):
    """Explicit Q, K, V for a left-padded batch: prefill of max(prompt_lens), then one token per step."""
    g = torch.Generator().manual_seed(seed)
    P = max(prompt_lens)
    L = P + new_tokens
    q, k, v = (torch.randn(len(prompt_lens), n, L, D, generator=g) for n in (H, H_KV, H_KV))
    coord = torch.arange(L)[None]
    start = P - torch.tensor(prompt_lens)[:, None]
    pos = (coord - start).masked_fill(coord < start, -1)
    return q, k, v, pos, P


def run_cache(sparse, q, k, v, pos, P, seed=0, layers=1, sliding_window=None):
    """Feed the tensors through KVCache exactly as the model would (the same Q, K, V in each of `layers`
    layers, under the model's `sliding_window`); -> cache, layer 0's outputs [B, H, L, D]."""
    cache = KVCache(sparse, num_layers=layers, max_new_tokens=q.shape[2] - P, seed=seed, record=True)
    outs = []
    for cols in [slice(0, P)] + [slice(c, c + 1) for c in range(P, q.shape[2])]:
        cache.start_step(pos[:, cols])
        for layer in range(layers):
            cache.update(k[:, :, cols], v[:, :, cols], layer)
            out = cache.attend(layer, q[:, :, cols], scaling=D ** -0.5, sliding_window=sliding_window)
            outs += [out] if layer == 0 else []
    return cache, torch.cat(outs, dim=2)


def kept_positions(cache):
    """Per step, the valid kept positions per (row, KV head), as sorted lists."""
    return [[[sorted(p for p in step[b, h].tolist() if p >= 0) for h in range(step.shape[1])]
             for b in range(step.shape[0])] for step in cache.history[0]]


def check_against_one_prompt_reference(sparse, lengths=LENGTHS, new_tokens=24, sliding_window=None):
    """Each row of a left-padded batch keeps, step by step, what `simulate_cache` keeps for its prompt alone,
    and attends to the same outputs. -> the cache."""
    q, k, v, pos, P = random_steps(lengths, new_tokens)
    cache, out = run_cache(sparse, q, k, v, pos, P, sliding_window=sliding_window)
    steps = kept_positions(cache)
    for b in range(len(lengths)):
        real = pos[b] >= 0
        ref_steps, ref_out = simulate_cache(sparse, q[b][:, real], k[b][:, real], v[b][:, real], lengths[b],
                                            scaling=D ** -0.5, sliding_window=sliding_window)
        assert [step[b] for step in steps] == ref_steps, f"row {b}"
        assert torch.allclose(out[b][:, real].double(), ref_out, atol=1e-5)
    return cache


@pytest.mark.parametrize("policy", ["full", "streaming", "h2o", "snapkv", "rkv"])
def test_each_row_of_a_padded_batch_keeps_what_the_one_prompt_reference_keeps(policy):
    # the reference runs one prompt at a time with no padding, as the authors' code does; our cache runs
    # the left-padded batch of mixed lengths, where rows fall due on different steps
    sparse = SparseConfig(policy, budget=7, interval=3, window=3, sink=2, kernel=3)
    cache = check_against_one_prompt_reference(sparse)
    if policy != "full":
        assert cache.compressions > 3


@pytest.mark.parametrize("policy", ["streaming", "h2o", "snapkv", "rkv"])
@pytest.mark.parametrize("budget, interval, window, sink, lengths", [
    (7, 1, 3, 2, (7, 7, 7)),       # every prompt exactly the budget: a compression at every decode step from the first
    (6, 3, 3, 2, (8, 9, 10)),      # prompts one short of, at and one past budget + interval (each falls due at once)
    (5, 2, 5, 0, (11, 6, 2)),      # the window is the whole budget: no sink, nothing scored is kept
    (9, 1, 3, 6, (9, 10, 1)),      # the sinks fill all the budget the window leaves; a 1-token prompt
    (1, 4, 1, 0, (1, 1, 1)),       # the smallest budget: the newest token alone, after 4 steps of growth
], ids=["budget=prompt", "budget+interval", "window=budget", "sink=budget-window", "budget=1"])
def test_budget_window_and_sink_edges_keep_what_the_one_prompt_reference_keeps(policy, budget, interval, window, sink,
                                                                               lengths):
    sparse = SparseConfig(policy, budget=budget, interval=interval, window=window, sink=sink, kernel=3)
    cache = check_against_one_prompt_reference(sparse, lengths=lengths, new_tokens=14)
    assert cache.compressions >= 3


@pytest.mark.parametrize("policy", ["streaming", "h2o", "snapkv", "rkv"])
@pytest.mark.parametrize("sliding_window", [6, 9])
def test_a_sliding_window_scores_only_keys_a_query_still_sees(policy, sliding_window):
    # Mistral-style: a query at p sees keys > p - sliding_window. A key at or before newest - sliding_window is
    # seen by no later query, so a compression drops it; SnapKV's window softmax hides from each window query the
    # keys it no longer sees. Window 6 < budget 7: fewer keys than the budget are left, holes fill the rest.
    sparse = SparseConfig(policy, budget=7, interval=3, window=3, sink=2, kernel=3)
    cache = check_against_one_prompt_reference(sparse, sliding_window=sliding_window)
    assert cache.compressions > 3


@pytest.mark.parametrize("policy", ["streaming", "h2o", "snapkv", "rkv", "random"])
def test_a_sliding_window_model_keeps_only_keys_its_queries_still_see(policy):
    # a tiny Mistral whose window (8) the prompts pass; interval 1: every decode step compresses, so every one
    # attends only keys after its position - 8. Keeping an older one (a sink, an old heavy hitter) spent budget on
    # a key no query reads again. And eviction still equals masking.
    model = tiny_model("mistral", sliding_window=8)
    prompts = [list(range(1, 14)), list(range(3, 13)), list(range(5, 17))]
    sparse = SparseConfig(policy, budget=6, interval=1, window=2, sink=2, kernel=3)
    out = generate(model, prompts, sparse, max_new_tokens=12, record=True)
    for layer in out.kept:                                              # [T, N, H_kv, S] positions attended
        for t, step in enumerate(layer[1:], start=1):
            now = torch.tensor([len(p) - 1 + t for p in prompts])[:, None, None]   # the query's position
            assert ((step < 0) | (step > now - 8)).all(), f"step {t}"
            assert ((step >= 0).sum(-1) == 6).all()                        # the budget, all of it in the window
    assert torch.allclose(out.logprobs, masked_dense_logprobs(model, out), atol=1e-4)


@pytest.mark.parametrize("policy", ["h2o", "rkv"])
def test_scores_computed_in_chunks_match_the_one_prompt_reference(monkeypatch, policy):
    # H2O's prefill softmax and R-KV's similarity rows go CHUNK rows at a time; with CHUNK = 3 the 13-query
    # prefill and the up to 10 kept keys span several chunks, and every chunk must add to the same totals
    import hook
    import policies
    monkeypatch.setattr(hook, "CHUNK", 3)
    monkeypatch.setattr(policies, "CHUNK", 3)
    check_against_one_prompt_reference(SparseConfig(policy, budget=7, interval=3, window=3, sink=2, kernel=3))


@pytest.mark.parametrize("policy", ["snapkv", "rkv"])
def test_prompts_shorter_than_the_window_score_with_their_last_window_queries(policy):
    # window 5 > every prompt (4, 2, 3 tokens): the prefill fills only part of the ring of remembered queries and
    # the decode steps the rest; each compression scores with the row's last 5 queries (the 4-token row
    # compresses after 3 decode steps, when its ring still holds 2 prefill queries)
    sparse = SparseConfig(policy, budget=6, interval=1, window=5, sink=0, kernel=3)
    check_against_one_prompt_reference(sparse, lengths=(4, 2, 3), new_tokens=10)


def test_a_compressing_step_attends_the_compressed_cache():
    # docs/method.md section 2: compress, then attend (the R-KV repository attends first). A row of 5 prompt tokens,
    # budget 8, interval 4: the step of its 12th token compresses to 8 and attends those 8; no step attends 12
    sparse = SparseConfig("snapkv", budget=8, interval=4, window=2, sink=2, kernel=3)
    q, k, v, pos, P = random_steps(prompt_lens=(5, 5, 5), new_tokens=16)
    cache, _ = run_cache(sparse, q, k, v, pos, P)
    attended = [int((step[0, 0] >= 0).sum()) for step in cache.history[0]]
    assert attended == [5, 6, 7, 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11, 8, 9]


def test_streaming_keeps_sink_and_most_recent():
    sparse = SparseConfig("streaming", budget=6, interval=1, window=2, sink=2)
    q, k, v, pos, P = random_steps(prompt_lens=(5, 5, 5), new_tokens=10)
    cache, _ = run_cache(sparse, q, k, v, pos, P)
    last = pos[0, -1].item()
    assert kept_positions(cache)[-1][0][0] == [0, 1] + list(range(last - 3, last + 1))


def test_random_policy_is_seeded_and_keeps_the_window():
    sparse = SparseConfig("random", budget=6, interval=2, window=2, sink=0)
    q, k, v, pos, P = random_steps(prompt_lens=(8, 8, 8), new_tokens=12)
    first = kept_positions(run_cache(sparse, q, k, v, pos, P, seed=1)[0])
    again = kept_positions(run_cache(sparse, q, k, v, pos, P, seed=1)[0])
    other = kept_positions(run_cache(sparse, q, k, v, pos, P, seed=2)[0])
    assert first == again and first != other
    newest = pos[0, -1].item()
    assert {newest - 1, newest} <= set(first[-1][0][0])


def test_kept_tokens_stay_within_budget_plus_interval():
    sparse = SparseConfig("snapkv", budget=10, interval=4, window=2, sink=2)
    model = tiny_model("llama")
    out = generate(model, [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4, 5]], sparse,
                   max_new_tokens=40, temperature=1.0, record=True)
    tokens = torch.stack([torch.tensor([[int((s[b, h] >= 0).sum()) for h in range(H_KV)] for b in range(2)])
                          for s in out.kept[0]])                      # [steps, B, H_kv] valid kept tokens
    assert tokens.max() <= sparse.budget + sparse.interval
    assert out.stats["peak_kv_tokens"] <= sparse.budget + sparse.interval
    # right after a row compresses it holds exactly `budget` tokens
    dropped = tokens[1:] < tokens[:-1]
    assert dropped.any() and (tokens[1:][dropped] == sparse.budget).all()
    # bytes: 2 (K and V) * layers * batch * kv_heads * head_dim * 4 bytes (fp32) per slot
    per_slot = 2 * 2 * 2 * H_KV * (64 // 4) * 4   # K and V, 2 layers, 2 rows
    assert out.stats["peak_kv_bytes"] == out.stats["peak_kv_tokens"] * per_slot
    assert out.stats["dense_kv_bytes"] == (13 + out.tokens.shape[1] - 1) * per_slot


def test_blocktopk_equals_masking_and_keeps_the_reserved_pages():
    model = tiny_model("llama")
    prompts = [list(range(1, 21)), [3, 4, 5]]
    sparse = SparseConfig("blocktopk", budget=8, page_size=4, dense_layers=1)
    out = generate(model, prompts, sparse, max_new_tokens=30, temperature=1.0, seed=3, record=True)
    assert torch.allclose(out.logprobs, masked_dense_logprobs(model, out), atol=1e-4)
    dense = torch.stack([full_forward_logprobs(model, p, out.tokens[i].tolist()) for i, p in enumerate(prompts)])
    assert (out.logprobs - dense).abs().max() > 1e-2                   # the pages really changed something
    assert out.stats["peak_kv_tokens"] == out.stats["dense_kv_tokens"]  # nothing is evicted
    last = out.kept[1][-1]                                              # [B, H_kv, S] attended positions
    for b, length in enumerate(len(p) + 29 for p in prompts):
        for h in range(H_KV):
            seen = set(last[b, h][last[b, h] >= 0].tolist())
            pages = {p // 4 for p in seen}
            newest = (length - 1) // 4
            assert {0, newest - 1, newest} <= pages and len(pages) == 2 + 3   # 8 // 4 top pages + 3 reserved
            assert all(set(range(4 * p, min(4 * p + 4, length))) <= seen for p in pages)  # whole pages
    assert (out.kept[0][-1] >= 0).sum(-1).tolist() == [[49, 49], [32, 32]]             # the dense layer
    # per row: 4 (first page) + 8 (top pages) + newest two pages (row 0: 4 + 1, row 1: 4 + 4) -> 17, 20
    assert (out.kept[1][-1] >= 0).sum(-1).tolist() == [[17, 17], [20, 20]]


@pytest.mark.parametrize("policy", ["snapkv", "blocktopk"])
def test_recording_reads_nothing_back_while_decoding(monkeypatch, policy):
    # record=True (every --distill step) must cost no host sync per decode step: count every read of a
    # tensor's value during generate, with and without recording (a read per layer and step would add 2 * 29)
    model = tiny_model("llama")
    sparse = SparseConfig(policy, budget=8, interval=3, window=2, sink=2) if policy == "snapkv" else \
        SparseConfig("blocktopk", budget=4, page_size=4, dense_layers=1)
    reads = []
    for name in ("item", "tolist", "cpu", "__bool__", "__int__", "__float__"):
        def counted(self, *args, _read=getattr(torch.Tensor, name), _name=name, **kwargs):
            reads.append(_name)
            return _read(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    counts = []
    for record in (False, True):
        reads.clear()
        out = generate(model, [[1, 2, 3, 4, 5, 6, 7, 8, 9], [3, 4, 5]], sparse, max_new_tokens=30, record=record)
        counts.append(len(reads))
    assert counts[0] == counts[1]
    monkeypatch.undo()
    held = (out.kept[0][1:] >= 0).sum(-1)                              # [29 decode steps, 2, H_kv]: all recorded
    assert held.shape[0] == 29 and 0 < held.min() and held.max() <= 9 + 29


@pytest.mark.parametrize("captured", [False, True])
@pytest.mark.parametrize("policy", ["full", "streaming", "h2o", "snapkv", "rkv", "random", "blocktopk"])
def test_a_decode_step_attends_only_to_keys_before_its_query(policy, captured):
    # what lets a decode step's mask be `key position >= 0` alone (hook.attention): no slot it reads holds a
    # later position, whatever was evicted, padded or left empty in the static buffer
    sparse = SparseConfig(policy, budget=8, interval=3, window=2, sink=2, page_size=4, dense_layers=1)
    prompts = [list(range(1, 14)), [3, 4, 5], list(range(5, 12))]
    out = generate(tiny_model("llama"), prompts, sparse, max_new_tokens=20, seed=1, record=True, captured=captured)
    for layer in out.kept:                                              # [T, N, H_kv, S] positions attended
        for t, step in enumerate(layer[1:], start=1):
            now = torch.tensor([len(p) - 1 + t for p in prompts])[:, None, None]   # the query's position
            assert (step <= now).all() and ((step >= 0).sum(-1) > 0).all()

@pytest.mark.parametrize("policy", ["snapkv", "rkv"])
def test_queries_are_remembered_only_in_the_window_before_a_compression(monkeypatch, policy):
    # a compression scores with the last `window` (3) queries; a step more than 3 from every row's next one writes
    # none. The rollout must equal one in which every step remembers its query (ragged rows fall due apart), and
    # each compression must find the same queries in the same slots of the ring, so that its scores sum them in
    # the same order (as the captured step, which writes every step, does).
    model = tiny_model("llama")
    sparse = SparseConfig(policy, budget=8, interval=12, window=3, sink=2)
    prompts = [list(range(1, 21)), [3, 4, 5, 6, 7], list(range(9, 20))]
    calls, rings, compress = [], [], kvcache.compress
    monkeypatch.setattr(kvcache.Layer, "remember", lambda self, *a, _r=kvcache.Layer.remember: calls.append(1)
                        or _r(self, *a))
    monkeypatch.setattr(kvcache, "compress", lambda layer, *a: rings.append((layer.queries.clone(),
                        layer.query_pos.clone())) or compress(layer, *a))
    some = generate(model, prompts, sparse, max_new_tokens=40, temperature=1.0, seed=3)
    written, some_rings, start_step = len(calls), rings[:], KVCache.start_step

    def always(self, positions):
        start_step(self, positions)
        self.remembering = True
    monkeypatch.setattr(KVCache, "start_step", always)
    rings.clear()
    every = generate(model, prompts, sparse, max_new_tokens=40, temperature=1.0, seed=3)
    assert every.stats["compressions"] >= 3                              # the rows' compressions fall apart
    # 2 layers x 40 passes; each row needs 3 steps of its 12 and the 3 rows are out of step: at most 3/4
    assert len(calls) - written == 2 * 40 and written <= 2 * (1 + 39 * 3 / 4)
    assert torch.equal(some.tokens, every.tokens) and torch.equal(some.logprobs, every.logprobs)
    assert len(some_rings) == len(rings) and all(torch.equal(a, b) for x, y in zip(some_rings, rings)
                                                 for a, b in zip(x, y))


@pytest.mark.parametrize("captured", [False, True])
def test_every_sparse_layer_of_a_step_shares_one_page_plan(monkeypatch, captured):
    # page_plan's part of the choice is the same in every layer: made once a step, by the first sparse layer,
    # the rollout must equal one in which each of the 3 sparse layers makes its own (the old per-layer code)
    model = tiny_model("llama", num_hidden_layers=4)
    sparse = SparseConfig("blocktopk", budget=4, page_size=4, dense_layers=1)
    prompts = [list(range(1, 21)), [3, 4, 5]]
    calls, page_plan = [], kvcache.page_plan
    monkeypatch.setattr(kvcache, "page_plan", lambda *a: calls.append(1) or page_plan(*a))   # static's too
    shared = generate(model, prompts, sparse, max_new_tokens=24, temperature=1.0, seed=3, captured=captured)
    assert len(calls) == 23                                            # one a decode step
    for cls in (kvcache.KVCache, static.StaticCache):
        attend = cls.attend
        monkeypatch.setattr(cls, "attend", lambda self, *a, _attend=attend: setattr(self, "plan_pages", None)
                            or _attend(self, *a))
    own = generate(model, prompts, sparse, max_new_tokens=24, temperature=1.0, seed=3, captured=captured)
    assert len(calls) == 23 + 23 * 3                                   # ... or one a sparse layer
    assert torch.equal(shared.tokens, own.tokens) and torch.equal(shared.logprobs, own.logprobs)

@pytest.mark.parametrize("schedule", [None, Schedule((0, 20), (4, 12))], ids=["fixed", "scheduled"])
def test_blocktopk_pages_match_a_brute_force_choice(schedule):
    # every decode step, re-chosen with loops from the raw keys: page = position // 4, score = the
    # group-mean query . the page's mean key; first page + 2 newest + the budget // 4 best others (2; with the
    # schedule each row's own budget at its context: 1 page below 20 tokens, 3 from 20 on, so rows differ)
    sparse = SparseConfig("blocktopk", budget=8, page_size=4, dense_layers=0, schedule=schedule)
    q, k, v, pos, P = random_steps()
    cache, _ = run_cache(sparse, q, k, v, pos, P)
    for step, got in enumerate(kept_positions(cache)[1:]):
        col = P + step                                                 # the query's column
        for b in range(len(LENGTHS)):
            seen = [int(pos[b, c]) for c in range(col + 1) if pos[b, c] >= 0]   # positions so far
            column = {p: c for c in range(col + 1) for p in [int(pos[b, c])]}
            pages = sorted({p // 4 for p in seen})
            newest = pages[-1]
            for h in range(H_KV):
                query = q[b, 2 * h:2 * h + 2, col].mean(0)
                mean = {g: torch.stack([k[b, h, column[p]] for p in seen if p // 4 == g]).mean(0) for g in pages}
                others = [p for p in pages if p != 0 and p < newest - 1]
                top = (8 if schedule is None else schedule(len(seen))) // 4
                best = sorted(others, key=lambda p: -float(mean[p] @ query))[:top]
                expect = {0, newest - 1, newest, *best} & set(pages)
                assert got[b][h] == [p for p in seen if p // 4 in expect]


@pytest.mark.parametrize("kwargs, message", [
    (dict(policy="lru"), "unknown policy 'lru'"),
    (dict(policy="snapkv", budget=8, window=8, sink=4), "budget=8 must be >= window \\+ sink"),
    (dict(budget=0), "budget must be a positive integer"),
    (dict(interval=0), "interval must be a positive integer"),
    (dict(interval=-3), "interval must be a positive integer"),
    (dict(window=0), "window must be a positive integer"),
    (dict(sink=-1), "sink must be a non-negative integer"),
    (dict(kernel=4), "kernel must be odd"),
    (dict(lam=1.5), "lam must be at most 1, got 1.5"),
    (dict(policy="blocktopk", budget=8, page_size=16), "budget=8 must be >= page_size = 16"),
    (dict(page_size=0), "page_size must be a positive integer"),
    (dict(dense_layers=-1), "dense_layers must be a non-negative integer"),
    (dict(budget=16.5), "budget must be a positive integer, got 16.5"),        # an int, not just >= 1
    (dict(kernel=-1), "kernel must be a positive integer, got -1"),           # odd, yet no pooling width
    (dict(budget=2 ** 64), "budget must be at most 2\\*\\*40 \\(DENSE: never evicts\\), got 18446744073709551616"),
    (dict(interval=2 ** 63), "^interval must be at most 2\\*\\*40, got 9223372036854775808$"),  # not OverflowError

    # no number where one is meant: a bare TypeError from a comparison, or taken (True as a budget of 1)
    (dict(lam=None), "^lam must be a number in \\[0, 1\\], got None$"),
    (dict(lam="0.1"), "^lam must be a number in \\[0, 1\\], got '0.1'$"),
    (dict(lam=float("nan")), "^lam must be a number in \\[0, 1\\], got nan$"),
    (dict(lam=float("inf")), "^lam must be at most 1, got inf$"),
    (dict(lam=True), "^lam must be a number in \\[0, 1\\], got True$"),
    (dict(budget=None), "^budget must be a positive integer, got None$"),
    (dict(budget=True), "^budget must be a positive integer, got True$"),
    (dict(interval=True), "^interval must be a positive integer, got True$"),
    (dict(window="8"), "^window must be a positive integer, got '8'$"),
    (dict(sink=False), "^sink must be a non-negative integer, got False$"),
    (dict(kernel=float("inf")), "^kernel must be a positive integer, got inf$"),
    (dict(page_size=float("nan")), "^page_size must be a positive integer, got nan$"),
    (dict(dense_layers=True), "^dense_layers must be a non-negative integer, got True$"),
    (dict(dense_layers=2 ** 70), "^dense_layers must be at most 2\\*\\*40, got 1180591620717411303424$"),  # only a
    (dict(kernel=2 ** 41 + 1), "^kernel must be at most 2\\*\\*40, got 2199023255553$"),   # budget never evicts
    (dict(schedule=512),
     "^schedule must be a schedule.Schedule or controller.Controller \\(None: the fixed budget\\), got 512$"),
])
def test_bad_config_is_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SparseConfig(**kwargs)


def test_the_full_cache_takes_any_budget_it_never_uses():
    # evaluate.py --policy full --budget 3 was refused: "budget=3 must be >= window + sink", of a cache that keeps all
    assert SparseConfig("full", budget=3, window=50).budget == 3
    with pytest.raises(ValueError, match="budget=3 must be >= window \\+ sink = 50 \\+ 4"):
        SparseConfig("snapkv", budget=3, window=50)


def test_a_cache_is_named_as_the_tables_print_it():
    # train.py's summary and an evaluation's rows: a DENSE budget (2**40) reads "never evicts", not 1099511627776
    assert SparseConfig().name == "full cache, nothing evicted"
    assert SparseConfig("snapkv", budget=24).name == "snapkv, budget 24"
    assert SparseConfig("h2o", budget=2 ** 40).name == "h2o, budget 2**40 (never evicts)"
    assert SparseConfig("h2o", budget=2 ** 40 - 1).name == "h2o, budget 1099511627775"
    assert SparseConfig("rkv", schedule=Schedule((0, 64), (16, None))).name == "rkv, scheduled budget"


def test_under_bf16_autocast_the_cache_holds_bf16_at_half_the_bytes():
    # fp32 weights under bf16 autocast (train.py --dtype bfloat16): rotary makes the keys fp32, the values are bf16;
    # the cache stores both in bf16, what attention reads, and counts 2 bytes a value (the fp32 run's half)
    model, prompts = tiny_model("llama"), [[5, 9, 3, 7], [4, 17]]
    sparse = SparseConfig("snapkv", budget=8, interval=3, window=2, sink=2, kernel=3)
    fp32 = generate(model, prompts, sparse, max_new_tokens=12, temperature=0)
    caches = caches_passed(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = generate(model, prompts, sparse, max_new_tokens=12, temperature=0)
    layer = caches[-1].layers[0]
    assert layer.k_buf.dtype == layer.v_buf.dtype == torch.bfloat16
    assert bf16.stats["peak_kv_tokens"] == fp32.stats["peak_kv_tokens"]
    assert 2 * bf16.stats["peak_kv_bytes"] == fp32.stats["peak_kv_bytes"]


@pytest.mark.parametrize("policy", ["snapkv", "rkv", "h2o"])
def test_under_bf16_autocast_the_scores_stay_fp32(monkeypatch, policy):
    # train.py --dtype bfloat16 samples under autocast, which runs a matmul (and, on the CPU, a softmax) in bf16
    # whatever its operands: scores rounded to bf16 tie by the dozen, and the cut then falls by slot order. Each
    # compression of a bf16-autocast rollout keeps the slots the same cache keeps when scored with autocast off,
    # and H2O's accumulated weights are the fp32 ones.
    model = tiny_model("llama")
    sparse = SparseConfig(policy, budget=16, interval=6, window=4, sink=0, kernel=3)
    prompts = [[1 + (5 * j) % 60 for j in range(48)], [1 + (7 * j) % 60 for j in range(40)]]
    same, compress, attention = [], kvcache.compress, kvcache.attention

    def both(layer, *a):
        twin = copy.deepcopy(layer)
        with torch.autocast("cpu", enabled=False):
            compress(twin, *a)
        compress(layer, *a)
        same.append(torch.equal(layer.pos, twin.pos))

    def weights_both(*a, **kw):
        out, received = attention(*a, **kw)
        if kw.get("weights"):
            with torch.autocast("cpu", enabled=False):
                same.append(torch.equal(received, attention(*a, **kw)[1]) and received.dtype == torch.float32)
        return out, received

    monkeypatch.setattr(kvcache, "compress", both)
    monkeypatch.setattr(kvcache, "attention", weights_both)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = generate(model, prompts, sparse, max_new_tokens=20, temperature=1.0, seed=0)
    assert out.stats["compressions"] >= 3 and len(same) >= 3 and all(same)


def mix32(x):
    """Multiply-xorshift by 0x45d9f3b, two rounds, on a Python int: 32 bits in, 32 out (not "lowbias32", whose
    rounds multiply by 0x7feb352d and 0x846ca68b)."""
    x &= 0xFFFFFFFF
    for _ in range(2):
        x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    return (x >> 16) ^ x


@pytest.mark.parametrize("seed", [5, 2 ** 63 + 5, -3])
def test_random_policy_matches_a_loop_over_hashed_positions(seed):
    # `random` scores the token at position p of KV head h in layer l of a row that has seen `context` tokens
    # (this step's included) with mix32(mix32(mix32(seed * 1_000_003 + context + 65_537 * l) + h) + p),
    # and a compression keeps the window plus the best (budget - window) others. Re-done here one row, layer and
    # head at a time with Python ints: every layer, head and compression draws afresh, and a row's draw does not
    # depend on its batch-mates (mixed prompt lengths, so the rows fall due on different steps). 2 layers.
    # Any seed a torch.Generator takes: 2**63 + 5 times 1_000_003 overflowed a long at the first compression
    sparse = SparseConfig("random", budget=6, interval=3, window=2, sink=0)
    q, k, v, pos, P = random_steps()
    cache, _ = run_cache(sparse, q, k, v, pos, P, seed=seed, layers=2)
    for layer in range(2):
        got = [[[sorted(p for p in step[b, h].tolist() if p >= 0) for h in range(H_KV)] for b in range(len(LENGTHS))]
               for step in cache.history[layer]]
        for b, length in enumerate(LENGTHS):
            kept = [list(range(length)) for _ in range(H_KV)]
            for step in range(1, q.shape[2] - P + 1):
                context = length + step
                for h in range(H_KV):
                    kept[h].append(context - 1)
                    if len(kept[h]) - sparse.budget >= sparse.interval:
                        window = [p for p in kept[h] if p > context - 1 - sparse.window]
                        salt = mix32(seed * 1_000_003 + context + 65_537 * layer)
                        others = sorted((p for p in kept[h] if p not in window),
                                        key=lambda p: -mix32(mix32(salt + h) + p))
                        kept[h] = sorted(others[: sparse.budget - len(window)] + window)
                assert got[step][b] == kept, f"layer {layer}, row {b}, step {step}"
    assert cache.compressions > 3


def test_h2o_accumulates_the_attention_each_slot_received(monkeypatch):
    # H2O's `acc` [B, H_kv, S]: the attention each slot has received from every real query so far (prefill and
    # decode steps, the query at position 0 included), the mean over the KV head's G query heads. Nothing is
    # evicted here (budget 64), so slot = column. CHUNK = 3 makes the prefill's 13 queries five chunks.
    # Reference: a dense causal softmax per row, query head and query.
    import hook
    monkeypatch.setattr(hook, "CHUNK", 3)
    q, k, v, pos, P = random_steps(new_tokens=4)
    cache, _ = run_cache(SparseConfig("h2o", budget=64), q, k, v, pos, P)
    G, L = H // H_KV, q.shape[2]
    expected = torch.zeros(len(LENGTHS), H_KV, L, dtype=torch.float64)
    for b in range(len(LENGTHS)):
        for head in range(H):
            for c in range(L):
                if pos[b, c] >= 0:
                    seen = (pos[b] >= 0) & (pos[b] <= pos[b, c])
                    logits = q[b, head, c].double() @ k[b, head // G].double().T * D ** -0.5
                    expected[b, head // G] += logits.masked_fill(~seen, float("-inf")).softmax(-1) / G
    assert torch.allclose(cache.layers[0].acc.double(), expected, atol=1e-5)
    cache, _ = run_cache(SparseConfig("snapkv", budget=64), q, k, v, pos, P)
    assert cache.layers[0].acc is None                                 # only H2O keeps (and pays for) it


def test_buffers_hold_what_the_cache_can_reach_before_compressing():
    # slots preallocated per layer: prompt + max_new_tokens for `full` and `blocktopk` (nothing is evicted), else
    # min(prompt + max_new_tokens, max(prompt + 1, budget + interval)): the cache never holds more than that.
    snap = KVCache(SparseConfig("snapkv", budget=10, interval=4, window=2, sink=2), 1, max_new_tokens=40)
    assert [snap.capacity(p) for p in (3, 13, 20, 60)] == [14, 14, 21, 61]
    short = KVCache(SparseConfig("snapkv", budget=10, interval=4, window=2, sink=2), 1, max_new_tokens=5)
    assert [short.capacity(p) for p in (3, 8, 20)] == [8, 13, 21]
    for policy in ("full", "blocktopk"):
        cache = KVCache(SparseConfig(policy, budget=16, page_size=16), 1, max_new_tokens=40)
        assert [cache.capacity(p) for p in (3, 20)] == [43, 60]
    # under a schedule, its largest budget (8, then 12): 12 + 4; a dense bin: everything, prompt + 40
    scheduled = SparseConfig("snapkv", interval=4, window=2, sink=2, schedule=Schedule((0, 16, 32), (8, 12, 10)))
    assert KVCache(scheduled, 1, max_new_tokens=40).capacity(3) == 16
    dense_bin = SparseConfig("snapkv", interval=4, window=2, sink=2, schedule=Schedule((0, 16), (8, None)))
    assert KVCache(dense_bin, 1, max_new_tokens=40).capacity(3) == 43
    # a rollout's buffers are allocated once at that size and never grow: 13-token prompt, 40 new tokens
    sparse, model = SparseConfig("snapkv", budget=10, interval=4, window=2, sink=2), tiny_model("llama")
    caches = caches_passed(model)
    generate(model, [list(range(1, 14)), [3, 4, 5]], sparse, max_new_tokens=40, temperature=1.0)
    assert [(layer.k_buf.shape[2], layer.pos_buf.shape[2]) for layer in caches[-1].layers] == [(14, 14)] * 2



@pytest.mark.parametrize("policy", ["full", "blocktopk"])
def test_a_step_past_max_new_tokens_is_refused_by_name(policy):
    # the buffers are allocated once, for max_new_tokens decode steps (sampler.generate never runs past them);
    # a caller who feeds one more is told so before anything is written
    q, k, v, pos, P = random_steps(new_tokens=4)
    cache = KVCache(SparseConfig(policy, budget=16, page_size=4, dense_layers=0), num_layers=1, max_new_tokens=3)
    for cols in [slice(0, P)] + [slice(c, c + 1) for c in range(P, P + 4)]:
        cache.start_step(pos[:, cols])
        if cols.start == P + 3:
            with pytest.raises(ValueError, match=rf"^{P + 3} slots held \+ 1 new tokens do not fit the {P + 3} "
                                                 "allocated for the cache's max_new_tokens"):
                cache.update(k[:, :, cols], v[:, :, cols], 0)
            assert cache.layers[0].size == P + 3
        else:
            cache.update(k[:, :, cols], v[:, :, cols], 0)
            cache.attend(0, q[:, :, cols], scaling=D ** -0.5)


def test_a_multi_token_step_after_the_prefill_is_refused_by_name():
    # the cache takes the prompt in one pass, then one token a row a step. A second multi-token pass was taken for a
    # prefill: it never compressed (interval 1 attended 10 slots, budget 8) and restarted the ring of window queries
    # with 2, whose 3 empty slots (position -1) saw no key and made the next SnapKV scores NaN
    q, k, v, pos, P = random_steps(new_tokens=4)
    cache = KVCache(SparseConfig("snapkv", budget=8, interval=1, window=5, sink=0), num_layers=1, max_new_tokens=4)
    cache.start_step(pos[:, :P])
    cache.update(k[:, :, :P], v[:, :, :P], 0)
    cache.attend(0, q[:, :, :P], scaling=D ** -0.5)
    with pytest.raises(ValueError, match="^a step after the prefill feeds 1 token per row, got 2$"):
        cache.start_step(pos[:, P:P + 2])
    assert cache.row_tokens.tolist() == list(LENGTHS)                   # refused before any bookkeeping


def test_defaults_are_the_official_settings_and_the_smallest_budget_is_allowed():
    # docs/method.md section 2 (Sparse-RL: budget 512, interval 128, window 8, 4 sinks, lam 0.1, kernel 7) and
    # section 3 (Sparrow: 16-token pages, the first 2 layers dense)
    sparse = SparseConfig()
    assert (sparse.policy, sparse.budget, sparse.interval, sparse.window, sparse.sink, sparse.lam, sparse.kernel,
            sparse.page_size, sparse.dense_layers) == ("full", 512, 128, 8, 4, 0.1, 7, 16, 2)
    # a budget of exactly window + sink (one page for blocktopk) still leaves the policy a choice
    assert SparseConfig("snapkv", budget=12, window=8, sink=4).budget == 12
    assert SparseConfig("blocktopk", budget=16, page_size=16).budget == 16


def test_the_host_bookkeeping_reaches_any_device():
    # a compressing step sends its due rows, salt and counts to the cache's device; anything but CUDA got the host
    # tensor back, so on MPS or XPU the first compression mixed devices ("Tensor on device cpu is not on the expected
    # device"). The meta device stands in for them here
    moved = kvcache.to_device(torch.tensor([3, 2]), torch.device("meta"))
    assert moved.device.type == "meta"
    host = torch.tensor([3, 2])
    assert kvcache.to_device(host, torch.device("cpu")) is host           # a CPU cache: no copy at all


def test_a_model_called_without_positions_gets_them_from_the_tokens_seen_not_the_slots_held():
    # transformers numbers a forward pass's tokens from `get_seq_length()` when no position_ids come. It returned the
    # slots held: after a compression (13 tokens -> budget 8) the next token was given position 8 instead of 13, its
    # rotary angle was wrong, and the logits moved. The positions fed before the announced step are what it means
    model, prompt = tiny_model("llama"), torch.tensor([list(range(3, 16))])
    sparse = SparseConfig("snapkv", budget=8, interval=2, window=2, sink=2)
    logits = {}
    for explicit in (True, False):
        cache, ids, rows, start = KVCache(sparse, model.config.num_hidden_layers, max_new_tokens=6), prompt, [], 0
        with sparse_attention(model), torch.no_grad():
            for _ in range(7):
                pos = torch.arange(start, start + ids.shape[1])[None]
                cache.start_step(pos)
                assert cache.get_seq_length() == start
                out = model(ids, **({"position_ids": pos} if explicit else {}), **{kvcache.CACHE_ARG: cache},
                            kv_cache=cache)
                rows.append(out.logits[:, -1])
                ids, start = out.logits[:, -1:].argmax(-1), start + ids.shape[1]
        assert cache.compressions > 0 and cache.kv_tokens < 13 + 6
        logits[explicit] = torch.cat(rows)
    torch.testing.assert_close(logits[False], logits[True])


def test_compressions_counts_the_steps_on_which_any_row_compresses():
    # `compressions` (sampler's stats["compressions"], bench_static's "compressions") counts compressing STEPS, not
    # rows: the rows of a padded batch fall due on different steps, and a step on which two do is one compression.
    # Reference: each row alone, counted with a plain loop (its tokens grow by one a step; at budget + interval it
    # is cut back to the budget), and the union of the steps. Budget 7, interval 3, prompts 9, 5, 13: at the first
    # decode step rows 0 and 2 both fall due (one compression, not two): 15 steps.
    sparse = SparseConfig("snapkv", budget=7, interval=3, window=3, sink=2, kernel=3)
    q, k, v, pos, P = random_steps()
    cache, _ = run_cache(sparse, q, k, v, pos, P)
    steps, rows = set(), 0
    for length in LENGTHS:
        held = length
        for step in range(1, q.shape[2] - P + 1):
            held += 1
            if held - sparse.budget >= sparse.interval:
                steps.add(step)
                rows, held = rows + 1, sparse.budget
    assert cache.compressions == len(steps) == 15 and rows > 15


@pytest.mark.parametrize("policy", ["snapkv", "rkv"])
def test_a_budget_a_schedule_lowers_compresses_with_the_last_window_queries(monkeypatch, policy):
    # A schedule that lowers the budget (16 below a 20-token context, 8 from there on) brings a compression forward:
    # the 13-token row at 19 tokens is 3 over 16, far from its next compression at interval 6, yet at 20 tokens it is
    # 12 over 8 and compresses at once. SnapKV and R-KV score with the last `window` queries, so with a schedule
    # every step must remember its query: each compression's due rows must find in their ring exactly the positions
    # of their last 3 queries (newest - 2 .. newest), not stale ones from the prefill.
    sparse = SparseConfig(policy, budget=8, interval=6, window=3, sink=2, kernel=3,
                          schedule=Schedule((0, 20), (16, 8)))
    q, k, v, pos, P = random_steps()
    seen, compress = [], kvcache.compress

    def check(layer, sparse, rows, *a):
        for b in rows.tolist():
            newest = int(layer.pos[b].max())
            seen.append((sorted(layer.query_pos[b].tolist()), list(range(newest - 2, newest + 1))))
        return compress(layer, sparse, rows, *a)
    monkeypatch.setattr(kvcache, "compress", check)
    cache, _ = run_cache(sparse, q, k, v, pos, P)
    assert cache.compressions >= 3 and len(seen) >= 3
    assert all(ring == expect for ring, expect in seen)


def test_peak_kv_tokens_is_the_most_slots_any_step_held():
    # stats["peak_kv_tokens"] (and peak_kv_bytes) is the MOST slots a layer held at any step, counted before the
    # step's compression (the new token stored, the cut not yet made), not the last step's count. Reference: each
    # row alone with a plain loop, its tokens grow by one a step and are cut to the budget at budget + interval;
    # the buffers are as long as the longest row. Prompts of 5: the peak is budget + interval = 11, reached at
    # steps 6, 9, 12 and 15, never at the last (step 16: 9 slots) nor at the 5-token prefill
    sparse = SparseConfig("snapkv", budget=8, interval=3, window=2, sink=2, kernel=3)
    q, k, v, pos, P = random_steps(prompt_lens=(5, 5, 5), new_tokens=16)
    cache, _ = run_cache(sparse, q, k, v, pos, P)
    held, most = 5, 5
    for _ in range(16):
        held += 1
        most = max(most, held)
        held = sparse.budget if held - sparse.budget >= sparse.interval else held
    assert cache.peak_kv_tokens == most == 11 and cache.kv_tokens == held == 9
    assert cache.peak_kv_bytes == 11 * cache.bytes_per_slot


def test_a_compression_that_leaves_no_hole_lets_decode_steps_go_unmasked(monkeypatch):
    # `Layer.holes` says whether a decode step must mask: the left-padded prefill (9, 5, 13 tokens) leaves holes, and
    # with interval 1 rows 0 and 2 are cut to budget 7 at every step from step 1. At step 1 row 1 holds 6 tokens in
    # 7 slots (a hole: masked); at step 2 it holds 7 and the compressing step drops its padding. From then on every
    # slot holds a real token: no hole, so every later decode step attends unmasked (a stale `holes` would build and
    # apply a mask on every step of the rollout).
    masked, attention = [], kvcache.attention
    monkeypatch.setattr(kvcache, "attention", lambda *a, **kw: masked.append(kw["masked"]) or attention(*a, **kw))
    sparse = SparseConfig("streaming", budget=7, interval=1, window=2, sink=2)
    q, k, v, pos, P = random_steps(new_tokens=8)
    cache, _ = run_cache(sparse, q, k, v, pos, P)
    assert masked == [True, True] + [False] * 7                         # the prefill, step 1, then none
    assert not cache.layers[0].holes and (cache.layers[0].pos >= 0).all()


@pytest.mark.parametrize("policy", ["streaming", "snapkv"])
def test_a_sliding_window_masks_decode_steps_of_an_unpadded_batch(policy):
    # with no padding every slot is a real key and `holes` stays False, yet between compressions (interval 3) a
    # decode step of a window-6 model holds up to 10 keys, some older than its window: it must still mask them
    # (hook.visible), as the one-prompt reference's queries see only keys > position - 6
    sparse = SparseConfig(policy, budget=7, interval=3, window=3, sink=2, kernel=3)
    cache = check_against_one_prompt_reference(sparse, lengths=(9, 9, 9), sliding_window=6)
    assert cache.compressions > 3 and not cache.layers[0].holes
