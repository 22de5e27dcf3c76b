"""Which tokens a sparse rollout keeps: the scoring policies and Sparrow's page choice (docs/method.md
sections 2 and 3). Pure functions of tensors; `kvcache.py` holds the cache that calls them.

- One signature for every eviction policy: `score(rows, sparse) -> [b, H_kv, S]`, larger = keep, over
  the b rows of a layer that compress at this step. StreamingLLM, H2O, SnapKV, R-KV and random are
  five small functions; a new policy is one function in SCORERS and its name in `kvcache.POLICIES`.
  Only the scores of real tokens before the window are read: `kvcache.compress` then sets the window to
  +inf and padding and holes (pos -1) to -inf, so what a scorer gives those slots never matters. Under a
  sliding window, the keys no query sees again come to a scorer as holes too (`kvcache.compress`).
- SnapKV and R-KV score as their authors' code does (one prompt, no padding): window attention to the
  keys before the observation window, pooled along those keys only. A padded or evicted slot is no
  token's neighbour (`pool`), so a row's choice never depends on the other prompts of its batch.
- `keep_indices` turns scores into the slots that survive; `top_pages` is block top-k's choice of
  pages for one decode step, from running page sums of the keys (`page_plan`: its part every layer shares).

    from policies import SCORERS, Rows
    scores = SCORERS["snapkv"](Rows(keys, pos, acc, queries, query_pos, scaling, salt), sparse)
"""
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

CHUNK = 256  # queries (H2O) or keys (R-KV) per [.., CHUNK, S] block: never a whole [B, H, S, S] at once


# ----------------------------------------------------------------------------- scoring policies

@dataclass
class Rows:
    """What a scoring policy reads: the b rows of one layer that compress at this step."""

    keys: torch.Tensor       # [b, H_kv, S, D]
    pos: torch.Tensor        # [b, H_kv, S] positions, -1 = padding or a hole
    acc: torch.Tensor        # [b, H_kv, S] attention received so far (H2O; else None)
    queries: torch.Tensor    # [b, H, W, D] the last `window` queries (SnapKV, R-KV; else None)
    query_pos: torch.Tensor  # [b, W]; every one is a real token when a row compresses
    scaling: float
    salt: torch.Tensor       # [b] long: (seed, layer, context) of each row, for `random`


def window_logits(rows):
    """Scaled logits of the window queries against every kept key, per KV group: [b, H_kv, G, W, S] in fp32
    (the operands are upcast before the product, so nothing is rounded to bf16 first)."""
    q = rows.queries.float().unflatten(1, (rows.keys.shape[1], -1))                  # [b, H_kv, G, W, D]
    return q @ rows.keys.float()[:, :, None].transpose(-1, -2) * rows.scaling


def before_window(rows, window):
    """[b, H_kv, S]: the valid slots before the observation window (the last `window` positions,
    always kept). SnapKV and R-KV choose among these only."""
    newest = rows.pos.amax(-1, keepdim=True)
    return (rows.pos >= 0) & (rows.pos <= newest - window)


def pool(x, mask, kernel, how):
    """Pool scores x [b, H, S] along the slots where `mask` holds, as if no other slot existed.

    The authors' code pools a batch-1 sequence of the keys before the window; here padding, holes
    left by eviction and the window sit among the slots, so the slots `mask` keeps are packed to the
    front (stable: sequence order kept), pooled, and put back. The ends are padded as F.avg_pool1d
    (zeros, counted in the mean) and F.max_pool1d (-inf) pad them, as in the authors' code.
    `how`: "avg" (SnapKV) or "max" (R-KV).
    """
    if how not in ("avg", "max"):
        raise ValueError(f"unknown pooling {how!r}; allowed: avg, max")
    order = mask.to(torch.uint8).argsort(dim=-1, descending=True, stable=True)       # [b, H, S]
    fill = 0.0 if how == "avg" else float("-inf")
    packed = x.gather(-1, order).masked_fill(~mask.gather(-1, order), fill).flatten(0, 1)[:, None]
    pool1d = F.avg_pool1d if how == "avg" else F.max_pool1d
    pooled = pool1d(packed, kernel, stride=1, padding=kernel // 2).view_as(x)
    return torch.empty_like(x).scatter_(-1, order, pooled)


def redundancy(keys, valid, threshold=0.5):
    """R-KV's redundancy of each valid key of a head (`cal_similarity` in its code): [b, H_kv, S].

    Cosine similarities between the valid keys, diagonal zeroed; in each row the latest key more
    similar than `threshold` (or, if none, the first key) is zeroed as well, the one duplicate that
    row keeps. A key's redundancy is the mean of its column over all valid rows, softmaxed over the
    valid keys. CHUNK rows at a time, never a whole [b, H_kv, S, S].
    """
    k = keys.float() / (keys.float().norm(dim=-1, keepdim=True) + 1e-8)
    slot = torch.arange(k.shape[2], device=k.device)
    first = valid.int().argmax(-1, keepdim=True)                        # [b, H_kv, 1] the first valid slot
    column_sum = 0.0
    for start in range(0, k.shape[2], CHUNK):
        sim = k[:, :, start:start + CHUNK] @ k.transpose(-1, -2)                       # [b, H_kv, c, S]
        own = slot[start:start + sim.shape[2], None] == slot
        sim = sim.masked_fill(own | ~valid[:, :, None] | ~valid[:, :, start:start + CHUNK, None], 0.0)
        duplicate = sim > threshold
        last = torch.where(duplicate.any(-1), (duplicate * slot).amax(-1), first)        # [b, H_kv, c]
        column_sum = column_sum + sim.scatter(-1, last[..., None], 0.0).sum(2)
    mean = column_sum / valid.sum(-1, keepdim=True)
    return mean.masked_fill(~valid, float("-inf")).softmax(-1)


def streaming(rows, sparse):
    """StreamingLLM (Xiao et al. 2023): the first `sink` tokens, then the most recent ones. Padding and holes
    (pos -1 < sink) score +inf here; `kvcache.compress` drops them (-inf) before choosing, so no real token
    loses its place to one."""
    return torch.where(rows.pos < sparse.sink, float("inf"), rows.pos.float())


def h2o(rows, sparse):
    """H2O (Zhang et al. 2023): the heavy hitters, i.e. the attention each token received so far."""
    return rows.acc


def snapkv(rows, sparse):
    """SnapKV (Li et al. 2024), as its code scores: each window query's softmax over the keys it may see
    (causal within the window), summed over the window, average-pooled along the keys before the window.
    Its code keeps a cache per query head; one per KV head takes the mean over the group (as kvpress)."""
    kp, qp = rows.pos[:, :, None, None, :], rows.query_pos[:, None, None, :, None]
    probs = window_logits(rows).masked_fill((kp < 0) | (kp > qp), float("-inf")).softmax(-1)
    return pool(probs.sum(3).mean(2), before_window(rows, sparse.window), sparse.kernel, "avg")


def rkv(rows, sparse):
    """R-KV (Cai et al. 2025), as its code scores: lam * importance - (1 - lam) * redundancy. Importance:
    the max over a group's logits, then each window query's softmax over the keys before the window,
    MEAN over the window (mass 1, the redundancy's scale), max-pooled along those keys."""
    before = before_window(rows, sparse.window)
    logits = window_logits(rows).amax(2).masked_fill(~before[:, :, None], float("-inf"))   # [b, H_kv, W, S]
    importance = pool(logits.softmax(-1).mean(2), before, sparse.kernel, "max")
    return sparse.lam * importance - (1 - sparse.lam) * redundancy(rows.keys, rows.pos >= 0)


def hash32(x):
    """A 32-bit integer hash of each element of a long tensor (multiply-xorshift by 0x45d9f3b; not "lowbias32")."""
    x = x & 0xFFFFFFFF
    for _ in range(2):
        x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    return (x >> 16) ^ x


def random(rows, sparse):
    """A baseline: every token equally likely to stay. Uniform numbers hashed from (seed, layer, context,
    KV head, position) rather than drawn from a shared generator, so a row's choice does not depend on
    its batch-mates, and is the same on every device."""
    head = torch.arange(rows.pos.shape[1], device=rows.pos.device)[None, :, None]
    return hash32(hash32(hash32(rows.salt)[:, None, None] + head) + rows.pos).float() / 2 ** 32


SCORERS = {"streaming": streaming, "h2o": h2o, "snapkv": snapkv, "rkv": rkv, "random": random}


def keep_indices(scores, count, n):
    """Which slots survive a compression: scores [B, H_kv, S] (+inf: must stay, -inf: must go),
    count [B]: the tokens each row keeps, n = max(count) (a host int). -> (index, kept), both [B, H_kv, n].

    The buffers stay rectangular, so n is the most any row keeps; a row that keeps fewer fills
    the rest of its n slots with evicted tokens that `kept` marks False. `index` is in slot order.
    """
    # a stable sort, so ties (common after max-pooling) go to the earlier slot, reproducibly
    ranked = scores.sort(dim=-1, descending=True, stable=True).indices[..., :n]
    kept = (torch.arange(n, device=scores.device) < count[:, None])[:, None].expand_as(ranked)
    index, order = ranked.sort(dim=-1)
    return index, kept.gather(-1, order)


# ----------------------------------------------------------------------------- block top-k

NEWEST_PAGES = 2                    # block top-k always attends a row's 2 newest pages (its local window)
RESERVED_PAGES = 1 + NEWEST_PAGES   # and its first (the attention sinks), beside the budget's best pages


def attended_pages(budget, page_size):
    """Pages a block top-k step attends at `budget`: the budget's best pages, plus the first and the 2 newest."""
    return budget // page_size + RESERVED_PAGES


class PagePlan(NamedTuple):
    """What block top-k's choice at one decode step shares across its layers (`page_plan`)."""

    tokens: torch.Tensor   # [B, 1, n]  long, tokens in each page (at least 1): page sums / tokens = mean keys
    #                                   (an integer divisor keeps the scores in the product's dtype: bf16 under autocast)
    bias: torch.Tensor     # [B, 1, n]  added to page scores: -inf for a page with no token yet, +inf for the
    #                                   reserved pages (the first: the sinks; the 2 newest: the local window)
    chosen: torch.Tensor   # [B, 1, min(k, n)]  bool, the ranks a row attends: its first min(top, pages it has)
    offset: torch.Tensor   # [B, 1, 1, page_size]  the slots of page 0's tokens (left padding + 0 .. page_size-1)
    window: int = None     # the sliding window it was made for (None: none); a layer with another makes its own


def page_plan(count, top, k, pos, page_size, query_pos=None, sliding_window=None):
    """Sparrow block top-k, the part of a decode step's page choice that is the same in every layer.

    Every layer holds the same positions, so the same pages exist and are reserved, and a row attends the
    same number of them; only their scores differ. Computed once a step (by the first sparse layer) rather than
    once a layer: an eager GPU step is bound by its kernel launches, and this part is most of `top_pages`'s.
    count [B, N]: tokens per page (`Layer.page_count`); top [B]: pages each row attends, the budget's best plus
    the reserved (device); k (host): the ranks gathered, at least min(max(top), the pages pos spans);
    pos [B, H_kv, S]: the positions of the slots a step looks at, -1 where none (the held slots of the eager
    cache, or static.py's buffer to its span). `sliding_window` (the layer's, as `hook.visible` applies it; None: none)
    with query_pos [B, 1], the step's positions: the pages wholly before the window are not attended. -> PagePlan.
    """
    n = (pos.shape[-1] - 1) // page_size + 1                            # no position reaches page n yet
    count = count[:, :n]
    pages, exists = torch.arange(n, device=count.device), count > 0
    held = exists.sum(-1, keepdim=True)                                 # [B, 1]: pages fill from 0 up
    reserved = exists & ((pages == 0) | (pages >= held - NEWEST_PAGES))
    if sliding_window is not None:
        # A page whose last position, (page + 1) * page_size - 1, is <= query - sliding_window holds no key the
        # query sees (`hook.visible`), nor any later query: it scores -inf as a page not yet held does, ranks last,
        # and takes none of the row's `top` ranks, which go to pages the attention sees. Page 0 too, reserved or
        # not: it is reserved for the attention sinks (StreamingLLM), tokens every query sees, and under a sliding
        # window none is (Hugging Face's sliding-window cache keeps none either); reserving the oldest page in
        # the window instead would be a rule of our own. Its rank goes to the best page in view, so a step
        # still attends `attended_pages` pages where the window holds that many, all of them seen.
        exists = exists & (pages >= (query_pos - sliding_window + 1) // page_size)     # [B, n]
        held, reserved = exists.sum(-1, keepdim=True), reserved & exists
    bias = torch.zeros(count.shape, device=count.device).masked_fill(~exists, float("-inf")).masked_fill(
        reserved, float("inf"))
    # Every page a row has (in view) scores finitely (a mean key . query), every other -inf: ranked by score,
    # the ones it has come first, so it attends its first min(top, held) ranks.
    chosen = torch.arange(min(k, n), device=count.device) < torch.minimum(top[:, None], held)
    padding = (pos[:, 0] >= 0).int().argmax(-1)                        # [B] slots before position 0 (the first real)
    offset = padding[:, None] + torch.arange(page_size, device=count.device)
    return PagePlan(count.clamp(min=1)[:, None], bias[:, None], chosen[:, None], offset[:, None, None], sliding_window)


def top_pages(layer, query, plan, pos):
    """Sparrow block top-k: the slots one decode query [B, H, 1, D] attends to -> (index, pos), [B, H_kv, S'].

    Pages are `page_size` positions of a row (position // page_size, so left padding does not
    shift them). Each KV head scores a page by its group-averaged query against the page's mean
    key (from the running sums `Layer.add_pages` keeps: one vector per page is read, not every key);
    `plan` (`page_plan`, this step's) adds the reserved pages and says how many ranks each row keeps.
    `index` lists the slots of the k pages the most generous row attends, best page first, so attention
    gathers and reads only those; `pos` is -1 where a slot is not attended (past a row's tokens, or
    beyond its `top`). `pos` [B, H_kv, S]: the positions of the slots looked at, as in `page_plan`.
    """
    size, n = pos.shape[-1], plan.bias.shape[-1]
    sums = layer.page_sum[:, :, :n]                                     # [B, H_kv, n, D]
    q = query.float().unflatten(1, (sums.shape[1], -1)).mean(2)           # [B, H_kv, 1, D]
    # (a row vector times the page sums: a batched matrix-vector product is several times slower on a CPU)
    score = (q @ sums.transpose(-1, -2))[:, :, 0] / plan.tokens + plan.bias   # mean key . query [B, H_kv, n]
    # A stable sort, not topk: topk orders tied scores (frequent in bf16) by its k and the buffer's length, both
    # set by the batch's most generous row, so a row's pages would depend on its batch-mates. Ties: earlier page.
    ranked = score.sort(dim=-1, descending=True, stable=True).indices[..., :plan.chosen.shape[-1]]   # [B, H_kv, k]
    slot = (ranked * layer.page_size)[..., None] + plan.offset           # [B, H_kv, k, page_size]
    seen = (plan.chosen[..., None] & (slot < size)).flatten(2)           # [B, H_kv, k * page_size]
    index = slot.flatten(2).clamp(max=size - 1)
    return index, torch.where(seen, pos.gather(2, index), -1)
