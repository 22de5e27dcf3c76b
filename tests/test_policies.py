"""policies.py by hand: the scores ignore padding and holes, and keep_indices keeps what the scores say."""
import pytest
import torch

import policies
import sampler
from kvcache import Layer, SparseConfig
from policies import SCORERS, Rows, attended_pages, keep_indices, page_plan, pool, redundancy, top_pages
from reference import HostReads, _pool, _scores, masked_dense_logprobs, tiny_model
from sampler import generate

H, H_KV, D = 4, 2, 8


@pytest.mark.parametrize("policy", ["snapkv", "rkv"])
def test_padding_and_holes_are_no_tokens_neighbours(policy):
    # one row's slots scored as they are, and again with invalid slots (padding in front, holes left by
    # eviction in the middle, filled with large random keys) among them: the valid slots' scores agree
    g = torch.Generator().manual_seed(0)
    sparse = SparseConfig(policy, budget=8, window=3, sink=2, kernel=5)
    S, W = 12, sparse.window
    keys, queries = torch.randn(1, H_KV, S, D, generator=g), torch.randn(1, H, W, D, generator=g)
    pos = torch.arange(S).expand(1, H_KV, S)
    query_pos = torch.arange(S - W, S)[None]
    rows = Rows(keys, pos, torch.zeros(1, H_KV, S), queries, query_pos, D ** -0.5, torch.zeros(1, dtype=torch.long))
    clean = SCORERS[policy](rows, sparse)
    slots = [None, None, *range(5), None, None, None, *range(5, S)]       # None: padding or a hole
    holey = torch.stack([keys[0, :, i] if i is not None else 10 * torch.randn(H_KV, D, generator=g) for i in slots], 1)
    holey_pos = torch.tensor([-1 if i is None else i for i in slots]).expand(1, H_KV, len(slots))
    scores = SCORERS[policy](Rows(holey[None], holey_pos, torch.zeros(holey_pos.shape), queries, query_pos,
                                  D ** -0.5, torch.zeros(1, dtype=torch.long)), sparse)
    real = holey_pos[0, 0] >= 0
    before = pos[0, 0] <= S - 1 - W                                    # the window's scores are not used
    assert torch.allclose(scores[..., real][..., before], clean[..., before], atol=1e-6)


@pytest.mark.parametrize("how", ["avg", "max"])
def test_pool_sees_only_the_masked_slots_even_with_negative_scores(how):
    # pool along the valid slots as if the others did not exist, against the loop reference (F.*_pool1d's edges:
    # zeros counted in the mean, max over what exists). Negative scores: a masked slot that entered the max as a 0
    # (rather than -inf) would win it; R-KV's softmax scores are >= 0, so only a direct test sees that
    g = torch.Generator().manual_seed(0)
    x = -torch.rand(2, H_KV, 11, generator=g) - 0.5                      # all negative
    mask = torch.rand(2, H_KV, 11, generator=g) > 0.4
    mask[0, 0] = True                                                     # one head with no hole at all
    got = pool(x, mask, 5, how)
    for b in range(2):
        for h in range(H_KV):
            valid = mask[b, h]
            expected = torch.tensor(_pool(x[b, h][valid].tolist(), 5, how))
            assert torch.allclose(got[b, h][valid], expected, atol=1e-6), (b, h)


def test_keep_indices_by_hand():
    # row 0 keeps 3 of its 6 slots: the window slot (+inf), then the scores 3.0 and 2.0; padding (-inf) goes.
    # Row 1 keeps its 5 valid tokens. The buffers stay rectangular (5 slots): row 0's two extra slots are
    # its next-best evicted tokens, in slot order, marked not kept.
    inf = float("inf")
    scores = torch.tensor([[-inf, 0.5, 3.0, 0.1, 2.0, inf],
                           [inf, inf, inf, -inf, inf, inf]])[:, None]
    index, kept = keep_indices(scores, torch.tensor([3, 5]), 5)
    assert index.tolist() == [[[1, 2, 3, 4, 5]], [[0, 1, 2, 4, 5]]]
    assert kept.tolist() == [[[False, True, False, True, True]], [[True] * 5]]


@pytest.mark.parametrize("chunk", [policies.CHUNK, 2])
def test_redundancy_by_hand(monkeypatch, chunk):
    # (chunk 2: the same values when the rows come 2 at a time, as past CHUNK = 256 keys; a chunk's diagonal or its
    # rows' validity read at slots 0.. rather than at the chunk's own slots passed with the whole 5 rows in one chunk)
    monkeypatch.setattr(policies, "CHUNK", chunk)
    # R-KV's redundancy over one head's keys [1, 1, 5, 4], slot 0 padding (a copy of slot 2's key: it must count for
    # nothing). Valid slots c = [1,1,1,1], a = [1,0,0,0], f = [3,4,0,0], g = [0,0,0,1]; exact cosines:
    #   c.a = 0.5  c.f = 0.7  c.g = 0.5  a.f = 0.6  a.g = 0  f.g = 0
    # Each row (diagonal zeroed) also zeroes its LAST slot with cosine strictly above 0.5, or, if none, the first
    # valid slot:   row c: 0.7 at f -> keeps a 0.5, g 0.5      row a: 0.6 at f -> keeps c 0.5
    #               row f: c 0.7, a 0.6 -> zeroes a, keeps c 0.7   row g: none above 0.5 -> zeroes c (first)
    # Column sums c 1.2, a 0.5, f 0, g 0.5; means over the 4 valid rows 0.3, 0.125, 0, 0.125; softmax over them.
    keys = torch.tensor([[1., 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [3, 4, 0, 0], [0, 0, 0, 1]])[None, None]
    valid = torch.tensor([False, True, True, True, True])[None, None]
    got = redundancy(keys, valid)
    expected = torch.tensor([0.3, 0.125, 0.0, 0.125]).softmax(-1)
    assert got[0, 0, 0] == 0.0
    assert torch.allclose(got[0, 0, 1:], expected, atol=1e-6)


def test_keep_indices_breaks_ties_toward_the_earlier_slot():
    # 20 equal scores [1, 1, 20] (a plain sort may reorder ties from 17 elements on): keeping 3 keeps slots 0, 1, 2,
    # the same slots on every run and device; with slot 5 scored higher, slots 5, 0, 1 (index in slot order)
    scores = torch.zeros(1, 1, 20)
    index, kept = keep_indices(scores, torch.tensor([3]), 3)
    assert index.tolist() == [[[0, 1, 2]]] and kept.all()
    scores[0, 0, 5] = 1.0
    assert keep_indices(scores, torch.tensor([3]), 3)[0].tolist() == [[[0, 1, 5]]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_are_ranked_in_the_precision_of_their_scores(dtype):
    # each KV head ranks its pages by (group-mean query . page sum) / page tokens; under bf16 autocast the product
    # is bf16, and dividing by the integer count keeps it so (a float divisor ranked bf16 ties differently).
    # 600 tokens in pages of 6 (not a power of two: a page's mean is inexact in bf16): 100 pages of nearly equal
    # keys, so that ties are many; the top 3 + the 3 reserved (first, 2 newest), the same pages in both rows.
    torch.manual_seed(0)
    layer = Layer(torch.zeros(2, H_KV, 1, D), 640, page_size=6)
    keys, positions = torch.randn(2, H_KV, 600, D) * 0.05 + 1.0, torch.arange(600).expand(2, -1)
    layer.append(keys, torch.zeros_like(keys), positions)
    query = torch.randn(2, H, 1, D).abs() + 1.0
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        plan = page_plan(layer.page_count, torch.tensor([6, 6]), 6, layer.pos, 6)
        index, _ = top_pages(layer, query, plan, layer.pos)
        q = query.float().unflatten(1, (H_KV, -1)).mean(2)
        score = (q @ layer.page_sum[:, :, :100].transpose(-1, -2))[:, :, 0] / layer.page_count[:, None, :100]
    assert score.dtype == dtype
    reserved = torch.zeros(100, dtype=torch.bool)
    reserved[[0, 98, 99]] = True
    score = score.masked_fill(reserved, float("inf")).tolist()
    ranked = [[sorted(range(100), key=lambda p: (-head[p], p))[:6] for head in row] for row in score]   # ties: earlier
    assert (index[..., ::6] // 6).tolist() == ranked                                  # each chosen page's first slot


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_pages_do_not_depend_on_its_batch_mates(dtype, device="cpu"):   # tests/test_gpu.py: on CUDA
    # a row attending 3 + 3 pages, alone and beside a row that attends 20 and holds 40 pages more (so the ranks
    # gathered and the pages scored are the batch-mate's): the same slots, in bf16 too, where scores tie often
    torch.manual_seed(0)
    keys, query = torch.randn(2, H_KV, 840, D) * 0.05 + 1.0, torch.randn(2, H, 1, D).abs() + 1.0
    keys, query = keys.to(device), query.to(device)
    lengths = [600, 840]

    def attended(rows, top):   # the rows left-padded to the longest: positions -1, ..., -1, 0, 1, ...
        S = max(lengths[r] for r in rows)
        pos = torch.stack([(torch.arange(S, device=device) - S + lengths[r]).clamp(min=-1) for r in rows])
        layer = Layer(torch.zeros(len(rows), H_KV, 1, D, device=device), S + 40, page_size=6)
        layer.append(keys[rows, :, -S:], torch.zeros_like(keys[rows, :, -S:]), pos)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            plan = page_plan(layer.page_count, torch.tensor(top, device=device), max(top), layer.pos, 6)
            return top_pages(layer, query[rows], plan, layer.pos)[1][0]           # row 0's positions, -1: not attended

    alone, beside = attended([0], [6]), attended([0, 1], [6, 23])
    assert sorted(alone[alone >= 0].tolist()) == sorted(beside[beside >= 0].tolist())


def test_pool_refuses_an_unknown_mode_by_name():
    # "mean" (a typo for "avg") max-pooled silently; it must name itself and the modes allowed
    x, mask = torch.rand(1, 1, 5), torch.ones(1, 1, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"'mean'.*avg.*max"):
        pool(x, mask, 3, "mean")



@pytest.mark.parametrize("arch, overrides", [
    ("mistral", dict(sliding_window=16)),
    ("qwen2", dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=16, max_window_layers=2))],
    ids=["mistral", "qwen2-full-then-sliding"])
def test_blocktopk_attends_no_page_past_a_sliding_window(monkeypatch, arch, overrides):
    # A window of 16 (a query at p sees keys > p - 16, `hook.visible`) passes page 0 (the reserved first page) and
    # others, mid-rollout for the short prompt: a page whose last position is <= p - 16 is chosen by no step of a
    # sliding layer (eager or captured), and each step attends attended_pages(4, 4) = 4 pages it can see (of 4 or
    # 5 in view): the budget spent on what the attention sees. The log-probs are still a dense pass's under the
    # recorded masks. Qwen2's layer 1 is full, its layer 2 slides: one step, two page plans. Before: the window
    # was ignored, page 0 stayed reserved, and a step saw 2 or 3 of the 4 pages it paid for. No step reads the device
    model, reads = tiny_model(arch, **overrides), HostReads()
    monkeypatch.setattr(sampler, "decode", reads.watch(sampler.decode))
    windows = [getattr(layer.self_attn, "sliding_window", 16) for layer in model.model.layers]   # Mistral: config's
    sparse = SparseConfig("blocktopk", budget=4, page_size=4, dense_layers=1)
    prompts = [list(range(1, 41)), [4, 17, 6, 9, 3]]
    runs = [generate(model, prompts, sparse, max_new_tokens=30, temperature=1.0, seed=3, record=True,
                     captured=captured) for captured in (False, True)]
    for out in runs:
        assert (masked_dense_logprobs(model, out) - out.logprobs).abs().max() < 1e-5
        for layer, W in enumerate(windows[1:], 1):
            for step in range(1, out.tokens.shape[1]):
                for b, prompt in enumerate(prompts):
                    query = len(prompt) + step - 1                     # the position step `step` feeds
                    first = 0 if W is None else max(0, (query - W + 1) // 4)   # the first page with a key > query - W
                    for head in out.kept[layer][step, b]:
                        pages = sorted({p // 4 for p in head.tolist() if p >= 0})
                        assert pages[0] >= first, (layer, step, b, pages, query)
                        assert len(pages) == min(attended_pages(4, 4), query // 4 + 1 - first), (layer, step, b, pages)
    assert reads.calls == 2 * 29 and reads.seen == []
    assert torch.equal(runs[0].tokens, runs[1].tokens)
    assert (runs[0].logprobs - runs[1].logprobs).abs().max() < 1e-5


@pytest.mark.parametrize("policy", ["streaming", "h2o", "snapkv", "rkv"])
def test_scorers_match_the_loop_reference(policy):
    # each scorer's scores of the keys before the window, against tests/reference.py's _scores (Python loops over the
    # keys, written from docs/method.md, nothing shared with policies.py): rows of 14 tokens, a window of 4, a sink of
    # 3, 2 query heads a KV head. The test above only compares a scorer with itself (holes or none), so a scorer
    # wrong the same way in both passed: the scaling or the query-head grouping of window_logits, the window's edge
    # (before_window), SnapKV's causal mask, group mean and pooling, R-KV's group max, window mean, sign and the keys
    # its redundancy reads, StreamingLLM's sink edge and order, H2O's scores. Values, not only an order: R-KV adds two
    # scores, so the scale of each counts
    g = torch.Generator().manual_seed(1)
    sparse = SparseConfig(policy, budget=10, window=4, sink=3, kernel=5)
    S, W, G = 14, sparse.window, H // H_KV
    keys, queries = torch.randn(2, H_KV, S, D, generator=g), torch.randn(2, H, S, D, generator=g)
    acc = torch.rand(2, H_KV, S, generator=g)
    rows = Rows(keys, torch.arange(S).expand(2, H_KV, S), acc, queries[:, :, S - W:], torch.arange(S - W, S).expand(2, W),
                D ** -0.5, torch.zeros(2, dtype=torch.long))
    got = SCORERS[policy](rows, sparse)
    kept, before, window = list(range(S)), list(range(S - W)), list(range(S - W, S))
    for b in range(2):
        for h in range(H_KV):
            expected = _scores(sparse, queries[b], keys[b], h, G, kept, before, window, dict(enumerate(acc[b, h].tolist())),
                               D ** -0.5, lambda c, s: s <= c)
            assert torch.allclose(got[b, h, :S - W].double(), torch.tensor(expected, dtype=torch.double), atol=1e-6), (b, h)


def _hash32(x):   # policies.hash32 in plain Python ints: x mod 2**32, two rounds of xorshift-16 and multiply, a last xorshift
    x &= 0xFFFFFFFF
    for _ in range(2):
        x = ((x >> 16) ^ x) * 0x45D9F3B % 2 ** 32
    return (x >> 16) ^ x


def test_random_hashes_salt_head_and_position_as_documented():
    # `random`'s number for a slot is hash32(hash32(hash32(salt) + KV head) + position) / 2**32, against a loop in
    # Python ints. The salts are kvcache's: seed % 2**32 * 1_000_003 + context + layer * 65_537, far above 2**32, so
    # hash32 must read them mod 2**32 first (holes' position -1 too). Nothing else pinned the hash: a changed
    # constant, shift or round, a hash without the KV head (every head then keeps the same tokens) or nested
    # differently all passed, and each changes which tokens a seed keeps
    salts = [(2 ** 32 - 1) * 1_000_003 + 17 + 5 * 65_537, 3]
    pos = torch.tensor([[-1, 0, 1, 2, 3, 250, 70_000, 123_456_789]] * H_KV)[None].expand(2, -1, -1)
    rows = Rows(None, pos, None, None, None, 1.0, torch.tensor(salts))
    got = SCORERS["random"](rows, None)
    expected = [[[_hash32(_hash32(_hash32(salt) + h) + p) / 2 ** 32 for p in pos[0, h].tolist()] for h in range(H_KV)]
                for salt in salts]
    assert got.dtype == torch.float32 and torch.equal(got, torch.tensor(expected))
    assert not torch.equal(got[:, 0], got[:, 1])                        # the KV heads choose apart


def test_attended_pages_by_hand():
    # the budget's whole pages (a part page buys none) plus the 3 reserved (the first, the 2 newest): a budget of 16
    # in pages of 4 attends 4 + 3, one of 17 or 19 the same (a ceiling gave them 5 + 3), one under a page only the 3.
    # The sliding-window test above holds budget = page_size, where the floor and the ceiling agree
    assert [attended_pages(b, 4) for b in (16, 17, 19, 3, 0)] == [7, 7, 7, 3, 3]
    assert attended_pages(64, 16) == 7 and attended_pages(100, 6) == 19


def test_page_plan_by_hand():
    # pages of 4 over 39 slots: 10 pages. Row 0: positions 0..38 (page 9 holds 36..38), query 38; row 1: 2 slots of
    # left padding, positions 0..36 (page 9 holds 36 alone), query 36; the count buffer has 2 pages more, empty.
    # No window: every page is held, the first and the 2 newest reserved (+inf), a row attends min(top, 10) ranks.
    # A sliding window of 16: a query at q sees the keys > q - 16, row 0's from 23 on, so page 5 (20..23) is still
    # in view and pages 0..4 are not (-inf, page 0 no longer reserved); row 1's from 21 on, pages 5..9 again. Each
    # attends min(top, 5 in view) ranks: row 0 asks 9 and gets 5. Mutants this catches: the window's first page
    # one later ((q - W + 2) // 4 drops row 0's page 5, which holds a key it sees), and `held` not recounted in view
    # (row 0 then took 9 ranks, 4 of them pages it cannot see); the sliding-window test above sees neither, its
    # steps having as many pages in view as they may attend. The offset: each row's left padding + 0..3
    count = torch.tensor([[4] * 9 + [3, 0, 0], [4] * 9 + [1, 0, 0]])
    pos = torch.stack([torch.arange(39), (torch.arange(39) - 2).clamp(min=-1)])[:, None].expand(2, H_KV, 39)
    top, inf = torch.tensor([9, 3]), float("inf")
    plan = page_plan(count, top, 10, pos, 4)
    assert plan.tokens.tolist() == [[[4] * 9 + [3]], [[4] * 9 + [1]]]
    assert plan.bias.tolist() == [[[inf] + [0.0] * 7 + [inf, inf]]] * 2
    assert plan.chosen.tolist() == [[[True] * 9 + [False]], [[True] * 3 + [False] * 7]]
    assert plan.offset.tolist() == [[[[0, 1, 2, 3]]], [[[2, 3, 4, 5]]]] and plan.window is None
    plan = page_plan(count, top, 10, pos, 4, query_pos=torch.tensor([[38], [36]]), sliding_window=16)
    assert plan.bias.tolist() == [[[-inf] * 5 + [0.0] * 3 + [inf, inf]]] * 2
    assert plan.chosen.tolist() == [[[True] * 5 + [False] * 5], [[True] * 3 + [False] * 7]]
    assert plan.window == 16
    # 40 slots fill exactly 10 pages: no 11th. `pos.shape[-1] // page_size + 1` (right at 39 slots) planned an empty
    # 11th page, and a row asking for more ranks than it has pages gathered 4 slots more a step, none of them seen
    plan = page_plan(torch.tensor([[4] * 10 + [0, 0]]), torch.tensor([12]), 12, torch.arange(40).expand(1, H_KV, 40), 4)
    assert plan.tokens.tolist() == [[[4] * 10]] and plan.chosen.tolist() == [[[True] * 10]]
