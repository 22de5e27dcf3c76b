"""The evictable KV cache, its scoring policies and the attention hook (METHOD.md section 2).

A sparse rollout keeps at most `budget` tokens per layer and KV head. The cache grows to
`budget + interval` tokens and is then compressed back to `budget`: a scoring policy gives
every cached token a score, and each row of the batch and each KV head keeps its own top
`budget` tokens. Everything else in the repo sees only `KVCache` and `SparseConfig`.

What is notable here:
- One signature for every policy: `score(layer, sparse) -> [B, H_kv, S]`, larger = keep.
  StreamingLLM, H2O, SnapKV, R-KV and random are five small functions; `keep_indices` turns
  scores into kept slots (padding evicted first, the recent `window` always kept).
- Cached keys keep the rotary position they were computed at; the attention mask is built
  from the absolute positions of the kept slots, so one rule (`key_pos <= query_pos`) serves
  prefill, decode and left padding alike.
- The hook is a plain attention function registered with transformers' public
  `AttentionInterface`; any Llama, Mistral, Qwen2 or Qwen3 model runs through it unchanged.
  It uses SDPA, and computes explicit attention weights only where a policy needs them
  (every step for H2O; the window queries at compression steps for SnapKV and R-KV).

    cache = KVCache(SparseConfig("snapkv", budget=64), num_layers, max_new_tokens=128)
    with sparse_attention(model):
        cache.start_step(positions)            # [B, q] absolute positions, -1 = padding
        model(ids, position_ids=positions.clamp(min=0), past_key_values=cache, kv_cache=cache)

`sampler.generate` does exactly this in a loop.

Block top-k (`blocktopk`, Sparrow, METHOD.md section 3) evicts nothing: each decode step gathers
each head's best pages, ranked by running page means of the keys, and attends to those only
(compute, not memory). `SparseConfig.schedule` (schedule.py) sets the budget from the context
length at every compression (every step for pages).
"""
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache

POLICIES = ("full", "streaming", "h2o", "snapkv", "rkv", "random", "blocktopk")
DENSE = 2 ** 40  # a budget that never evicts: what a schedule means by "dense"
SUPPORTED_MODELS = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class SparseConfig:
    """How the rollout's KV cache is compressed. Defaults: Sparse-RL's official settings."""

    policy: str = "full"  # one of POLICIES; "full" never evicts (dense rollouts)
    budget: int = 512     # tokens kept per layer and KV head right after a compression
    interval: int = 128   # decode steps between compressions once over budget (1: never above budget)
    window: int = 8       # most recent tokens, always kept; also the SnapKV / R-KV observation window
    sink: int = 4         # first tokens always kept by StreamingLLM ("attention sinks")
    lam: float = 0.1      # R-KV: score = lam * importance - (1 - lam) * redundancy (0.07 in the R-KV repo)
    kernel: int = 7       # pooling kernel of the SnapKV / R-KV importance along the sequence
    gqa: str = "mean"     # how the query heads of one KV group are aggregated: "mean" or "max"
    page_size: int = 16   # blocktopk: tokens per page; a step attends to budget // page_size top pages
    dense_layers: int = 2  # blocktopk: the first layers attend to every token (Sparrow keeps 2 dense)
    schedule: object = None  # a schedule.Schedule (or Controller): budget = schedule(context length)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; allowed: {', '.join(POLICIES)}")
        for name in ("budget", "interval", "window", "kernel", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("sink", "dense_layers"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {getattr(self, name)!r}")
        budget = min([self.budget] if self.schedule is None else [b for b in self.schedule.budgets if b],
                     default=self.min_budget)
        if budget < self.min_budget:
            raise ValueError(f"budget={budget} must be >= " + (f"page_size = {self.page_size}" if
                             self.policy == "blocktopk" else f"window + sink = {self.window} + {self.sink}"))
        if self.kernel % 2 == 0:
            raise ValueError(f"kernel must be odd so pooling keeps the sequence length, got {self.kernel}")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"lam must lie in [0, 1], got {self.lam}")
        if self.gqa not in ("mean", "max"):
            raise ValueError(f"gqa must be 'mean' or 'max', got {self.gqa!r}")

    @property
    def min_budget(self):
        """The smallest budget that still leaves the policy a choice: the always-kept window and sinks
        (for blocktopk, one page: the first and the 2 newest pages come on top of the budget's pages)."""
        return self.page_size if self.policy == "blocktopk" else self.window + self.sink


# ----------------------------------------------------------------------------- one layer's state

class Layer:
    """The kept tokens of one layer: slots [0, size) of preallocated buffers.

    keys, values  [B, H_kv, S, D]  kept keys (with their original rotary positions) and values
    pos           [B, H_kv, S]     absolute position of each kept slot; -1 marks left padding
    acc           [B, H_kv, S]     attention each slot has received so far (H2O)
    queries       [B, H, W, D]     the last `window` queries (SnapKV, R-KV), query_pos [B, W]
    holes         bool             whether any kept slot is invalid (pos -1); if not, a decode
                                   step needs no attention mask at all
    page_sum      [B, H_kv, n, D]  blocktopk only: running sum of each page's keys, page_count [B, n]
                                   its tokens (nothing is evicted, so slot = left padding + position)
    Slots stay in position order, so pooling along slots is pooling along the sequence.
    """

    def __init__(self, key, capacity, rng, page_size=None):
        B, H, _, D = key.shape
        self.k_buf = key.new_zeros(B, H, capacity, D)
        self.v_buf = key.new_zeros(B, H, capacity, D)
        self.pos_buf = torch.full((B, H, capacity), -1, dtype=torch.long, device=key.device)
        self.acc_buf = torch.zeros(B, H, capacity, dtype=torch.float32, device=key.device)
        self.queries, self.query_pos = None, None
        self.size, self.scaling, self.rng = 0, None, rng  # scaling: set by the hook
        self.holes = False
        self.page_size = page_size
        if page_size:   # positions < capacity, so capacity // page_size + 1 pages always suffice
            self.page_sum = torch.zeros(B, H, capacity // page_size + 1, D, dtype=torch.float32, device=key.device)
            self.page_count = torch.zeros(B, capacity // page_size + 1, dtype=torch.long, device=key.device)

    keys = property(lambda self: self.k_buf[:, :, : self.size])
    values = property(lambda self: self.v_buf[:, :, : self.size])
    pos = property(lambda self: self.pos_buf[:, :, : self.size])
    acc = property(lambda self: self.acc_buf[:, :, : self.size])

    def append(self, key, value, pos):
        """Write q new tokens at the end: key, value [B, H_kv, q, D], pos [B, q]."""
        q = key.shape[2]
        if self.size + q > self.k_buf.shape[2]:  # only if a caller runs past max_new_tokens
            self.k_buf, self.v_buf, self.pos_buf, self.acc_buf = (
                torch.cat([b, torch.full_like(b, -1 if b.dtype == torch.long else 0)], dim=2)
                for b in (self.k_buf, self.v_buf, self.pos_buf, self.acc_buf))
            if self.page_size:
                self.page_sum = torch.cat([self.page_sum, torch.zeros_like(self.page_sum)], dim=2)
                self.page_count = torch.cat([self.page_count, torch.zeros_like(self.page_count)], dim=1)
        end = self.size + q
        self.k_buf[:, :, self.size:end] = key
        self.v_buf[:, :, self.size:end] = value
        self.pos_buf[:, :, self.size:end] = pos[:, None, :]
        self.acc_buf[:, :, self.size:end] = 0.0
        self.size = end
        if self.page_size:   # blocktopk: keep each page's key sum, so choosing pages never reads every key
            valid, page = pos >= 0, pos.clamp(min=0) // self.page_size                # [B, q]
            self.page_count.scatter_add_(1, page, valid.long())
            self.page_sum.scatter_add_(2, page[:, None, :, None].expand_as(key), key.float() * valid[:, None, :, None])

    def gather(self, index):
        """The kept keys and values at slots `index` [B, H_kv, n] -> two [B, H_kv, n, D].

        Rows of D values are copied whole (`index_select` on the flattened buffers): several times
        faster on a CPU than `gather` with the index expanded over D, which reads one index per value.
        """
        B, H, capacity, D = self.k_buf.shape
        rows = (torch.arange(B * H, device=index.device).view(B, H, 1) * capacity + index).flatten()
        return tuple(buf.view(-1, D).index_select(0, rows).view(B, H, -1, D) for buf in (self.k_buf, self.v_buf))

    def remember(self, query, pos, window):
        """Keep the last `window` queries [B, H, q, D] and their positions [B, q]."""
        if self.queries is None:
            self.queries, self.query_pos = query[:, :, -window:], pos[:, -window:]
        else:
            self.queries = torch.cat([self.queries, query], dim=2)[:, :, -window:]
            self.query_pos = torch.cat([self.query_pos, pos], dim=1)[:, -window:]

    def keep(self, index, kept):
        """Move the slots `index` [B, H_kv, n] to the front; those not `kept` become invalid (-1)."""
        n = index.shape[-1]
        self.k_buf[:, :, :n], self.v_buf[:, :, :n] = self.gather(index)
        self.pos_buf[:, :, :n] = self.pos.gather(2, index).masked_fill(~kept, -1)
        self.acc_buf[:, :, :n] = self.acc.gather(2, index)
        self.size = n
        self.holes = bool((self.pos < 0).any())   # one check per compression, not per step


# ----------------------------------------------------------------------------- scoring policies
# Each returns [B, H_kv, S]; larger means keep. `keep_indices` later evicts padding first and
# always keeps the recent `window`, so a policy only ranks the rest.

def group(x, num_kv_heads, how):
    """Aggregate query heads [B, H, ...] into their KV groups [B, H_kv, ...] (GQA)."""
    x = x.unflatten(1, (num_kv_heads, -1))
    return x.mean(2) if how == "mean" else x.amax(2)


def pool(x, kernel, how):
    """Pool scores [B, H, S] along the sequence with a same-length window of `kernel` slots."""
    flat = x.flatten(0, 1)[:, None]
    if how == "max":
        flat = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    else:
        flat = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2, count_include_pad=False)
    return flat.view_as(x)


def window_attention(layer, sparse):
    """Attention of the last `window` queries to every kept key, summed over the window: [B, H_kv, S].

    The window queries are causal (each sees keys up to its own position); padding queries
    and not-yet-filled window slots (position -1) contribute nothing.
    """
    B, H, W, D = layer.queries.shape
    H_kv = layer.keys.shape[1]
    q = layer.queries.float().unflatten(1, (H_kv, -1))                  # [B, H_kv, G, W, D]
    logits = q @ layer.keys.float()[:, :, None].transpose(-1, -2) * layer.scaling  # [B, H_kv, G, W, S]
    key_pos, query_pos = layer.pos[:, :, None, None, :], layer.query_pos[:, None, None, :, None]
    allowed = (key_pos >= 0) & (key_pos <= query_pos)
    probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
    probs = probs.nan_to_num(0.0)                                       # rows of padding queries
    return group(probs.sum(3).flatten(1, 2), H_kv, sparse.gqa)


def redundancy(layer, sparse, threshold=0.5):
    """R-KV redundancy of each key within its head: [B, H_kv, S], a softmax over the slots.

    Cosine similarity between the keys of one head, diagonal zeroed; pairs above `threshold`
    count as duplicates, and a key's redundancy is its mean similarity to its duplicates
    over the valid slots, softmaxed along the sequence.
    """
    k = F.normalize(layer.keys.float(), dim=-1)
    sim = k @ k.transpose(-1, -2)                                       # [B, H_kv, S, S]
    valid = layer.pos >= 0
    eye = torch.eye(sim.shape[-1], dtype=torch.bool, device=sim.device)
    duplicate = (sim > threshold) & valid[..., None, :] & valid[..., :, None] & ~eye
    mean_sim = (sim * duplicate).sum(-1) / valid.sum(-1, keepdim=True).clamp(min=1)
    return mean_sim.masked_fill(~valid, float("-inf")).softmax(-1).nan_to_num(0.0)


def streaming(layer, sparse):
    """StreamingLLM (Xiao et al. 2023): the first `sink` tokens, then the most recent ones."""
    return torch.where(layer.pos < sparse.sink, float("inf"), layer.pos.float())


def h2o(layer, sparse):
    """H2O (Zhang et al. 2023): the heavy hitters, i.e. the attention each token received so far."""
    return layer.acc


def snapkv(layer, sparse):
    """SnapKV (Li et al. 2024): window attention, average-pooled so neighbours of a hit survive too."""
    return pool(window_attention(layer, sparse), sparse.kernel, "avg")


def rkv(layer, sparse):
    """R-KV (Cai et al. 2025): lam * importance - (1 - lam) * redundancy; importance max-pooled."""
    importance = pool(window_attention(layer, sparse), sparse.kernel, "max")
    return sparse.lam * importance - (1 - sparse.lam) * redundancy(layer, sparse)


def random(layer, sparse):
    """A baseline: every token equally likely to stay (seeded, so rollouts are reproducible)."""
    return torch.rand(layer.pos.shape, generator=layer.rng, device=layer.pos.device)


SCORERS = {"streaming": streaming, "h2o": h2o, "snapkv": snapkv, "rkv": rkv, "random": random}


def keep_indices(scores, pos, budget, window, due):
    """Which slots survive a compression: scores [B, H_kv, S] -> (index, kept), both [B, H_kv, S'].

    A row that is `due` [B] keeps its `budget` best tokens: padding (pos -1) goes first and
    the `window` most recent positions always stay. Other rows keep all their tokens. The
    buffers stay rectangular, so S' is the most any row keeps; a due row fills the rest of
    its S' slots with evicted tokens that `kept` marks False. `index` is in slot order.
    """
    valid = pos >= 0
    newest = pos.amax(dim=-1, keepdim=True)
    scores = scores.float().masked_fill(pos > newest - window, float("inf"))
    scores = torch.where(due[:, None, None], scores, float("inf")).masked_fill(~valid, float("-inf"))
    count = torch.where(due, budget, valid[:, 0].sum(-1))              # [B] tokens each row keeps
    # a stable sort, so ties (common after max-pooling) go to the earlier slot, reproducibly
    ranked = scores.sort(dim=-1, descending=True, stable=True).indices[..., : int(count.max())]
    kept = torch.arange(ranked.shape[-1], device=pos.device) < count[:, None, None]
    index, order = ranked.sort(dim=-1)
    return index, kept.expand_as(ranked).gather(-1, order)


def compress(layer, sparse, due, budget=None):
    """Score the layer's slots with the policy and keep, in every `due` [B] row, its best `budget`
    (an int or one per row [B]; default `sparse.budget`)."""
    scores = SCORERS[sparse.policy](layer, sparse)
    budget = sparse.budget if budget is None else budget
    layer.keep(*keep_indices(scores, layer.pos, budget, sparse.window, due))


def top_pages(layer, query, budget):
    """Sparrow block top-k: the slots one decode query [B, H, 1, D] attends to -> (index, pos), [B, H_kv, S'].

    Pages are `page_size` positions of a row (position // page_size, so left padding does not
    shift them). Each KV head scores a page by its group-averaged query against the page's mean
    key (from the running sums `Layer.append` keeps: one vector per page is read, not every key)
    and keeps its `budget // page_size` best pages (budget: int or [B]), plus the first page
    (the sinks) and the 2 newest (the local window). `index` lists the slots of the k pages the
    most generous row keeps, best page first, so attention gathers and reads only those; `pos` is
    -1 where a slot is not attended (past a row's tokens, or a page beyond that row's budget).
    """
    page_size = layer.page_size
    n = (layer.size - 1) // page_size + 1                               # no position reaches page n yet
    count, sums = layer.page_count[:, :n], layer.page_sum[:, :, :n]     # [B, n], [B, H_kv, n, D]
    q = group(query[:, :, -1:].float(), sums.shape[1], "mean")           # [B, H_kv, 1, D]
    # (a row vector times the page sums: a batched matrix-vector product is several times slower on a CPU)
    score = (q @ sums.transpose(-1, -2))[:, :, 0] / count.clamp(min=1)[:, None]   # mean key . query [B, H_kv, n]
    pages, exists = torch.arange(count.shape[1], device=count.device), count > 0
    newest = exists.sum(-1, keepdim=True) - 1                            # [B, 1]: pages fill from 0 up
    reserved = exists & ((pages == 0) | (pages >= newest - 1))           # [B, n]
    score = score.masked_fill(~exists[:, None], float("-inf")).masked_fill(reserved[:, None], float("inf"))
    top = torch.as_tensor(budget, device=count.device).reshape(-1) // page_size + reserved.sum(-1)   # [B] pages kept
    ranked = score.topk(min(int(top.max()), n), dim=-1).indices         # [B, H_kv, k], best first
    chosen = (torch.arange(ranked.shape[-1], device=count.device) < top[:, None, None]) & exists.gather(
        1, ranked.flatten(1)).view_as(ranked)
    padding = layer.size - count.sum(-1)                                # [B] slots before position 0
    slot = padding[:, None, None, None] + ranked[..., None] * page_size + torch.arange(page_size, device=count.device)
    seen = (chosen[..., None] & (slot < layer.size)).flatten(2)          # [B, H_kv, k * page_size]
    index = slot.flatten(2).clamp(max=layer.size - 1)
    return index, layer.pos.gather(2, index).masked_fill(~seen, -1)


# ----------------------------------------------------------------------------- attention

def attention(query, keys, values, key_pos, query_pos, scaling, sliding_window=None, need_weights=False,
              masked=True):
    """Attend queries [B, H, q, D] over kept slots [B, H_kv, S, D]; -> ([B, H, q, D], weights or None).

    Grouped-query attention without copies: the G = H / H_kv query heads that share a KV head
    become G * q query rows of that head, so each kept key is read once per group (not once per
    query head) and a mask made per KV head serves its whole group. `weights` are [B, H_kv, G * q, S].
    The mask comes from positions alone: a query at position p sees the valid keys at
    positions <= p (and > p - sliding_window for Mistral-style models). Padding queries
    (position -1) see every slot so their (unused) output stays finite. `masked=False` says
    the caller knows every slot is visible to every query (a decode step over real tokens).
    """
    B, H, q, D = query.shape
    G = H // keys.shape[1]
    rows = query.unflatten(1, (-1, G)).flatten(2, 3)                  # [B, H_kv, G * q, D]
    allowed = None
    if masked:
        kp, qp = key_pos[:, :, None, :], query_pos[:, None, :, None]   # [B, H_kv, 1, S], [B, 1, q, 1]
        allowed = (kp >= 0) & (kp <= qp)
        if sliding_window is not None:
            allowed &= kp > qp - sliding_window
        allowed |= qp < 0                                             # [B, H_kv, q, S]
        allowed = allowed[:, :, None].expand(-1, -1, G, -1, -1).flatten(2, 3)   # [B, H_kv, G * q, S]
    if need_weights:
        logits = (rows @ keys.transpose(-1, -2)).float() * scaling
        if allowed is not None:
            logits = logits.masked_fill(~allowed, float("-inf"))
        weights = logits.softmax(-1)
        out = weights.to(values.dtype) @ values
    else:
        weights = None
        out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=allowed, scale=scaling)
    return out.unflatten(2, (G, q)).flatten(1, 2), weights            # [B, H, q, D]


class KVCache(Cache):
    """A transformers `Cache` that keeps at most `budget + interval` tokens per layer and KV head.

    The caller announces each forward pass with `start_step(positions)`; the model then calls
    `update` (store the new keys and values) and our attention hook calls `attend` (compress
    if due, then attend) once per layer. Stats: `kv_tokens`, `peak_kv_tokens`, `kv_bytes`,
    `peak_kv_bytes`, `dense_kv_tokens` (what a full cache would hold), `compressions`, and
    `attended_tokens`: per decode step, the tokens attended per layer, row and KV head (mean).
    With `record=True`, `history[layer][step]` holds the kept positions [B, H_kv, S] each
    step attended over (tests rebuild the same attention from it with a dense masked pass).
    """

    def __init__(self, sparse, num_layers, max_new_tokens, seed=0, record=False):
        super().__init__(layers=[])
        self.sparse, self.num_layers, self.max_new_tokens = sparse, num_layers, max_new_tokens
        self.rng = None if sparse.policy != "random" else torch.Generator().manual_seed(seed)
        self.history = [[] for _ in range(num_layers)] if record else None
        self.step_pos, self.row_tokens, self.due, self.compressing, self.padded = None, 0, None, False, False
        self.context, self.budget, self.attended = 0, sparse.budget, []
        self.compressions, self.peak_kv_tokens, self.dense_kv_tokens, self.bytes_per_slot = 0, 0, 0, 0

    def start_step(self, positions):
        """Announce the next forward pass: positions [B, q] of its tokens (-1 for padding).

        Decides which rows compress at this step. Each row counts its own tokens, so a row's
        rollout does not depend on how long the other prompts of its batch are.
        """
        sparse, decode = self.sparse, bool(self.layers) and positions.shape[1] == 1
        self.step_pos, real = positions, (positions >= 0).sum(1)
        self.row_tokens = self.row_tokens + real                       # [B] real tokens held per row
        self.context = self.context + real                             # [B] ... and seen (the dense count)
        if sparse.schedule is not None:                                # METHOD.md section 6: grows with context
            self.budget = sparse.schedule(self.context)
        # Prefill is kept whole; once over budget, a row compresses every `interval` decode steps.
        over = self.row_tokens - self.budget
        self.due = (over > 0) & (over >= sparse.interval) & decode & (sparse.policy not in ("full", "blocktopk"))
        self.row_tokens = torch.where(self.due, self.budget, self.row_tokens)
        # Two host-side flags, decided once per step rather than once per layer.
        self.compressing, self.padded = bool(self.due.any()), bool((positions < 0).any())
        self.compressions += int(self.compressing)
        self.dense_kv_tokens += positions.shape[1]
        self.peak_kv_tokens = max(self.peak_kv_tokens, self.kv_tokens + positions.shape[1])
        self.decoding = decode
        if decode:
            self.attended.append(0.0)

    def capacity(self, prompt_len):
        """Slots to preallocate: everything for `full`, else what the cache can hold before compressing."""
        total, sparse = prompt_len + self.max_new_tokens, self.sparse
        if sparse.policy in ("full", "blocktopk"):
            return total
        budget = sparse.budget if sparse.schedule is None else max(b or DENSE for b in sparse.schedule.budgets)
        return min(total, max(prompt_len + 1, budget + sparse.interval))

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Called by the model: store new keys and values [B, H_kv, q, D]; return the kept ones."""
        if layer_idx == len(self.layers):
            paged = self.sparse.policy == "blocktopk" and layer_idx >= self.sparse.dense_layers
            self.layers.append(Layer(key_states, self.capacity(key_states.shape[2]), self.rng,
                                     self.sparse.page_size if paged else None))
            self.bytes_per_slot += 2 * key_states[:, :, :1].numel() * key_states.element_size()
        layer = self.layers[layer_idx]
        layer.append(key_states, value_states, self.step_pos)
        layer.holes = layer.holes or self.padded
        return layer.keys, layer.values

    def attend(self, layer_idx, query, scaling, sliding_window=None):
        """Called by the hook: compress if due, then attend. query [B, H, q, D] -> [B, H, q, D]."""
        layer, sparse = self.layers[layer_idx], self.sparse
        layer.scaling = scaling
        if sparse.policy in ("snapkv", "rkv"):
            layer.remember(query, self.step_pos, sparse.window)
        if self.compressing:
            compress(layer, sparse, self.due, self.budget)
        # A decode step over real earlier tokens only sees every slot: no mask to build or apply.
        masked = query.shape[2] > 1 or layer.holes or sliding_window is not None
        keys, values, key_pos = layer.keys, layer.values, layer.pos
        if sparse.policy == "blocktopk" and self.decoding and layer_idx >= sparse.dense_layers:
            index, key_pos = top_pages(layer, query, self.budget)
            (keys, values), masked = layer.gather(index), True
        if self.decoding:  # a tensor, not a float: no host sync per layer
            self.attended[-1] += (key_pos >= 0).sum(-1).float().mean() / self.num_layers
        out, weights = attention(query, keys, values, key_pos, self.step_pos, scaling,
                                 sliding_window, need_weights=sparse.policy == "h2o", masked=masked)
        if weights is not None:  # H2O: every query's attention adds to what each key has received
            weights = weights.unflatten(2, (-1, query.shape[2])) * (self.step_pos >= 0)[:, None, None, :, None]
            received = weights.sum(3).flatten(1, 2)                    # [B, H, S], summed over the queries
            layer.acc_buf[:, :, : layer.size] += group(received, layer.keys.shape[1], sparse.gqa)
        if self.history is not None:
            self.history[layer_idx].append(key_pos.clone())
        return out

    def get_seq_length(self, layer_idx=0):
        return self.layers[layer_idx].size if layer_idx < len(self.layers) else 0

    # slots currently held per layer and KV head, and the byte counts of the token counts
    kv_tokens = property(lambda self: self.layers[0].size if self.layers else 0)
    kv_bytes = property(lambda self: self.kv_tokens * self.bytes_per_slot)
    peak_kv_bytes = property(lambda self: self.peak_kv_tokens * self.bytes_per_slot)
    dense_kv_bytes = property(lambda self: self.dense_kv_tokens * self.bytes_per_slot)
    attended_tokens = property(lambda self: [float(a) for a in self.attended])


# ----------------------------------------------------------------------------- the hook

def sparse_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                             kv_cache=None, sliding_window=None, **kwargs):
    """transformers attention function "sparse_kv": attention over the `kv_cache`'s kept slots.

    transformers calls it from inside each attention layer after rotary embeddings and
    `kv_cache.update`; `key`, `value` and the (absent) `attention_mask` are ignored because
    the cache knows which slots are kept and where they sit.
    """
    if kv_cache is None:
        raise ValueError("the sparse_kv attention needs the cache: call model(..., kv_cache=cache)")
    out = kv_cache.attend(module.layer_idx, query, scaling, sliding_window)
    return out.transpose(1, 2), None


AttentionInterface.register("sparse_kv", sparse_attention_forward)


def check_model(model):
    """Raise a clear error for architectures whose attention we have not verified."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED_MODELS:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODELS)}")


@contextmanager
def sparse_attention(model):
    """Route the model's attention through `sparse_attention_forward` for the duration of a block."""
    check_model(model)
    previous = model.config._attn_implementation
    model.set_attn_implementation("sparse_kv")
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)
