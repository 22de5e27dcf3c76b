"""The evictable KV cache (docs/method.md section 2); hook.py routes a model's attention through it.

A sparse rollout keeps `budget` tokens per layer and KV head (a prompt over `budget + interval` whole until the first
decode step). The cache grows to `budget + interval` tokens and is then compressed back to `budget`: a scoring policy
(policies.py) gives every cached token a score, and each row of the batch and each KV head keeps its own top `budget`
tokens. Other files use `KVCache`, `SparseConfig`, the hook and a few constants and checks.

What is notable here:
- Cached keys keep the rotary position they were computed at, and each kept slot its absolute position
  (`pos`, -1 for padding or a hole): the attention mask is built from those alone (`hook.visible`), and a
  decode step, whose keys all came before its query or with it, needs only the valid slots, or no mask
  when it holds no hole.
- Every decision is per row: when it compresses, its budget, which of its tokens stay. A row's
  rollout never depends on the other prompts of its batch (tested).
- Bookkeeping lives on the host: how many tokens each row holds, which rows compress, their
  budgets. A decode step reads nothing back from the GPU, and a compressing step sends what its
  layers need in one asynchronous copy.
- The model calls `update` (store each layer's new keys and values, a transformers `Cache`'s job) and the
  hook calls `attend` (compress if due, then `hook.attention` over the kept slots), once per layer.

    cache = KVCache(SparseConfig("snapkv", budget=64), num_layers, max_new_tokens=128)
    with hook.sparse_attention(model):
        cache.start_step(positions)            # [B, q] absolute positions, -1 = padding
        model(ids, position_ids=positions.clamp(min=0), **{CACHE_ARG: cache}, kv_cache=cache)

`sampler.generate` does exactly this in a loop.

Block top-k (`blocktopk`, Sparrow, section 3) evicts nothing: each decode step gathers each
head's best pages (`policies.top_pages`) and attends to those only (compute, not memory).
`SparseConfig.schedule` (schedule.py) sets the budget from the context length.
"""
import inspect
import numbers
from dataclasses import dataclass

import torch
from transformers import LlamaForCausalLM
from transformers.cache_utils import Cache

from hook import attention
from policies import RESERVED_PAGES, SCORERS, Rows, keep_indices, page_plan, top_pages

POLICIES = ("full", "streaming", "h2o", "snapkv", "rkv", "random", "blocktopk")
DENSE = 2 ** 40  # a budget that never evicts: what a schedule means by "dense"
# transformers 5.24 renamed the models' `past_key_values` argument and output field to `cache`: the old name
# warns, and goes in 5.40; releases before 5.24 (the GPU machine has 5.17) know only the old one.
CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


def check_number(name, value, low, high, integer=True):
    """A ValueError naming the field, its value and what it allows, unless `value` is a number (an int if `integer`,
    never a bool, which Python counts as 1) in [low, high]. NaN fails every comparison, inf the upper bound."""
    if not isinstance(value, int if integer else numbers.Real) or isinstance(value, bool) or not low <= value:
        allowed = f"{'a positive' if low else 'a non-negative'} integer" if integer else f"a number in [{low}, {high}]"
        raise ValueError(f"{name} must be {allowed}, got {value!r:.40}")
    if value > high:
        dense = "2**40" + (" (DENSE: never evicts)" if name == "budget" else "")   # a budget that large keeps all
        raise ValueError(f"{name} must be at most {dense if high == DENSE else high}, got {value!r:.40}")


@dataclass
class SparseConfig:
    """How the rollout's KV cache is compressed. Defaults: Sparse-RL's official settings."""

    policy: str = "full"  # one of POLICIES; "full" never evicts (dense rollouts)
    budget: int = 512     # tokens kept per layer and KV head right after a compression
    interval: int = 128   # decode steps between compressions once over budget (1: no step attends > budget)
    window: int = 8       # most recent tokens, always kept; also the SnapKV / R-KV observation window
    sink: int = 4         # first tokens always kept by StreamingLLM ("attention sinks")
    lam: float = 0.1      # R-KV: score = lam * importance - (1 - lam) * redundancy (0.07 in the R-KV repo)
    kernel: int = 7       # pooling kernel of the SnapKV / R-KV importance along the sequence
    page_size: int = 16   # blocktopk: tokens per page; a step attends to budget // page_size top pages
    dense_layers: int = 2  # blocktopk: the first layers attend to every token (Sparrow keeps 2 dense)
    schedule: object = None  # a schedule.Schedule or controller.Controller: budget = schedule(context length)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; allowed: {', '.join(POLICIES)}")
        for name, least in dict(budget=1, interval=1, window=1, kernel=1, page_size=1, sink=0, dense_layers=0).items():
            check_number(name, getattr(self, name), least, DENSE)
        check_number("lam", self.lam, 0, 1, integer=False)
        if self.schedule is not None and not (callable(self.schedule) and hasattr(self.schedule, "budgets")):
            raise ValueError("schedule must be a schedule.Schedule or controller.Controller (None: the fixed "
                             f"budget), got {self.schedule!r:.80}")
        budget = min([self.budget] if self.schedule is None else [b for b in self.schedule.budgets if b],
                     default=self.min_budget)
        if budget < self.min_budget and self.policy != "full":             # full keeps everything: no budget
            raise ValueError(f"budget={budget} must be >= " + (f"page_size = {self.page_size}" if
                             self.policy == "blocktopk" else f"window + sink = {self.window} + {self.sink}"))
        if self.kernel % 2 == 0:
            raise ValueError(f"kernel must be odd so pooling keeps the sequence length, got {self.kernel}")

    @property
    def min_budget(self):
        """The smallest budget that still leaves the policy a choice: window + sink (only StreamingLLM always keeps
        the sinks, but every eviction policy is held to it); blocktopk: one page (first and 2 newest come on top)."""
        return self.page_size if self.policy == "blocktopk" else self.window + self.sink

    @property
    def largest_budget(self):
        """The most tokens a context keeps: the budget, or the largest of the schedule's (DENSE for a dense bin)."""
        return self.budget if self.schedule is None else max(b or DENSE for b in self.schedule.budgets)

    @property
    def name(self):
        """How the tables name this cache: "snapkv, budget 512"; DENSE reads "never evicts", not 1099511627776."""
        budget = ("scheduled budget" if self.schedule is not None else "budget 2**40 (never evicts)"
                  if self.budget >= DENSE else f"budget {self.budget}")
        return "full cache, nothing evicted" if self.policy == "full" else f"{self.policy}, {budget}"

    @property
    def pages(self):
        """Block top-k's page size; None for the eviction policies, which choose tokens, not pages."""
        return self.page_size if self.policy == "blocktopk" else None


# ----------------------------------------------------------------------------- one layer's state

class Layer:
    """The kept tokens of one layer: slots [0, size) of preallocated buffers.

    keys, values  [B, H_kv, S, D]  kept keys (with their original rotary positions) and values
    pos           [B, H_kv, S]     absolute position of each kept slot; -1 marks padding or a hole
    acc           [B, H_kv, S]     H2O only (else None): attention each slot has received so far
    queries       [B, H, W, D]     SnapKV, R-KV: a ring of the queries of the last `window` steps that remembered
                                   (`KVCache.remembering`), the last `window` queries at every compression;
                                   query_pos [B, W] their positions
    holes         bool             whether any kept slot is invalid (pos -1); if not, a decode
                                   step needs no attention mask at all (under a sliding window every
                                   step masks, and the holes `compress` leaves there go uncounted)
    page_sum      [B, H_kv, n, D]  blocktopk only: running sum of each page's keys, page_count [B, n]
                                   its tokens (nothing is evicted, so slot = left padding + position)
    Valid slots stay in position order (holes may sit between them).
    """

    def __init__(self, like, capacity, page_size=None, accumulate=False):
        """Empty buffers of `capacity` slots, shaped, typed and placed like `like` [B, H_kv, q, D]; `acc` only
        if `accumulate` (H2O): other policies would zero it for every new token and never read it."""
        B, H, _, D = like.shape
        self.k_buf = like.new_zeros(B, H, capacity, D)
        self.v_buf = like.new_zeros(B, H, capacity, D)
        self.pos_buf = torch.full((B, H, capacity), -1, dtype=torch.long, device=like.device)
        self.acc_buf = torch.zeros(B, H, capacity, dtype=torch.float32, device=like.device) if accumulate else None
        self.queries, self.query_pos, self.ring = None, None, 0
        self.size, self.holes = 0, False
        self.page_size = page_size
        if page_size:   # positions < capacity, so capacity // page_size + 1 pages always suffice
            self.page_sum = torch.zeros(B, H, capacity // page_size + 1, D, dtype=torch.float32, device=like.device)
            self.page_count = torch.zeros(B, capacity // page_size + 1, dtype=torch.long, device=like.device)

    keys = property(lambda self: self.k_buf[:, :, : self.size])
    values = property(lambda self: self.v_buf[:, :, : self.size])
    pos = property(lambda self: self.pos_buf[:, :, : self.size])
    acc = property(lambda self: None if self.acc_buf is None else self.acc_buf[:, :, : self.size])

    def append(self, key, value, pos):
        """Write q new tokens at the end: key, value [B, H_kv, q, D], pos [B, q]."""
        q = key.shape[2]
        self.check_room(q)
        end = self.size + q
        self.k_buf[:, :, self.size:end] = key
        self.v_buf[:, :, self.size:end] = value
        self.pos_buf[:, :, self.size:end] = pos[:, None, :]
        if self.acc_buf is not None:
            self.acc_buf[:, :, self.size:end] = 0.0
        self.size = end
        if self.page_size:
            self.add_pages(key, pos)

    def check_room(self, q):
        """A ValueError, before anything is written, unless q more tokens fit the buffers (sized once, for the
        cache's max_new_tokens decode steps)."""
        if self.size + q > self.k_buf.shape[2]:
            raise ValueError(f"{self.size} slots held + {q} new tokens do not fit the {self.k_buf.shape[2]} allocated "
                             "for the cache's max_new_tokens: announce no more steps than it was made for")

    def add_pages(self, key, pos):
        """blocktopk: add new keys [B, H_kv, q, D] at positions [B, q] to their pages' running sums, so
        choosing pages never reads every key."""
        valid, page = pos >= 0, pos.clamp(min=0) // self.page_size                    # [B, q]
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
        """Keep the last `window` queries [B, H, q, D] and positions [B, q] in a ring of `window` slots,
        written in place; called at the steps `KVCache.remembering` marks (a step that does not only turns the
        ring). q > 1 only at the prefill, whose last queries are copied: a view would keep its whole
        [B, H, P, D] alive."""
        if query.shape[2] > 1 or self.queries is None:
            n = min(query.shape[2], window)
            self.queries = query.new_zeros(*query.shape[:2], window, query.shape[3])
            self.query_pos = pos.new_full((pos.shape[0], window), -1)
            self.queries[:, :, :n], self.query_pos[:, :n] = query[:, :, -n:], pos[:, -n:]
            self.ring = n % window
        else:
            self.queries[:, :, self.ring], self.query_pos[:, self.ring] = query[:, :, 0], pos[:, 0]
            self.ring = (self.ring + 1) % window

    def keep(self, index, kept):
        """Move the slots `index` [B, H_kv, n] to the front; those not `kept` become holes (-1)."""
        n = index.shape[-1]
        self.k_buf[:, :, :n], self.v_buf[:, :, :n] = self.gather(index)
        self.pos_buf[:, :, :n] = self.pos.gather(2, index).masked_fill(~kept, -1)
        if self.acc_buf is not None:
            self.acc_buf[:, :, :n] = self.acc.gather(2, index)
        self.size = n


# ----------------------------------------------------------------------------- compression

def compress(layer, sparse, rows, salt, count, n, scaling, sliding_window=None):
    """Score the slots of the `rows` [b] that are due with the policy, and keep `count` [B] tokens in every
    row (n = max count, a host int): the due rows their best, padding first out and the `window` always
    in; the others all their tokens. Only the due rows are scored: rows fall due on different steps.
    `salt` [b]: the due rows' (seed, layer, context), for `random`. Tensors on the cache's device.
    `scaling`: the layer's attention scale, for SnapKV's and R-KV's window logits. `sliding_window`: the
    layer's (Mistral-style, as `hook.visible` applies it; None: none), past which a due row's keys go."""
    scores = torch.where(layer.pos >= 0, float("inf"), float("-inf"))
    remembered, acc = layer.queries is not None, layer.acc      # queries: SnapKV and R-KV only; acc: H2O only
    pos = layer.pos[rows]                                                           # [b, H_kv, S]
    if sliding_window is not None:
        # A key at or before newest - sliding_window is out of the compressing query's window (`hook.visible`:
        # a query at p sees keys > p - sliding_window), and out of every later, newer query's: it is never
        # attended again. Every scorer sees it as a hole, and it goes, as Hugging Face's sliding-window cache
        # (`DynamicSlidingWindowLayer`) drops it; its slot goes to a key a query can still see. This also
        # masks, in SnapKV's and R-KV's window softmax, the keys an older window query at qp no longer sees
        # (kp <= qp - sliding_window <= newest - sliding_window), as that query's attention did.
        pos = pos.masked_fill(pos <= pos.amax(-1, keepdim=True) - sliding_window, -1)
    due = Rows(layer.keys[rows], pos, None if acc is None else acc[rows],
               layer.queries[rows] if remembered else None, layer.query_pos[rows] if remembered else None,
               scaling, salt)
    recent = due.pos > due.pos.amax(-1, keepdim=True) - sparse.window   # ~policies.before_window in 3 launches, not 7
    with torch.autocast(scores.device.type, enabled=False):   # fp32 scores: bf16 autocast would round them into ties
        scored = SCORERS[sparse.policy](due, sparse).masked_fill(recent, float("inf"))
        scores[rows] = scored.masked_fill(due.pos < 0, float("-inf"))          # the window stays, padding and holes go
    index, kept = keep_indices(scores, count, n)
    if sliding_window is not None:   # `count` counts slots: where fewer keys are left in the window, holes fill them
        kept &= scores.gather(-1, index) > float("-inf")   # (`layer.holes` need not know: a sliding window masks)
    layer.keep(index, kept)


def to_device(host, device):
    """A small host tensor on `device` without a sync: a copy from pageable memory would make the host
    wait for the GPU's queue to drain, one from pinned memory runs in the background. Any other device
    (a CPU: no copy; MPS, XPU) takes a plain copy."""
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


class KVCache(Cache):
    """A transformers `Cache` that keeps at most `budget + interval` tokens per layer and KV head (a longer
    prompt whole, until the first decode step compresses it).

    The caller announces each forward pass with `start_step(positions)`; the model then calls
    `update` (store the new keys and values) and our attention hook calls `attend` (compress
    if due, then attend) once per layer. Stats: `kv_tokens`, `peak_kv_tokens`, `peak_kv_bytes`,
    `dense_kv_tokens` (what a full cache would hold), `compressions`.
    With `record=True`, `history[layer][step]` holds the kept positions [B, H_kv, S] each step
    attended over, a copy on the device (a count would read the device once per layer and step) in
    int16, or int32 where the last position passes 32767 (`record_dtype`);
    `sampler.generate` stacks it into `Rollouts.kept`, from which tests rebuild the same attention with a
    dense masked pass.
    """

    def __init__(self, sparse, num_layers, max_new_tokens, seed=0, record=False):
        super().__init__(layers=[])
        self.sparse, self.num_layers, self.max_new_tokens, self.seed = sparse, num_layers, max_new_tokens, seed
        self.history = [[] for _ in range(num_layers)] if record else None
        self.row_tokens = self.context = 0     # [B] host tensors from the prefill on
        self.step_pos, self.padded, self.decoding, self.budget = None, False, False, sparse.budget
        self.compressions, self.peak_kv_tokens, self.dense_kv_tokens, self.bytes_per_slot = 0, 0, 0, 0
        # start_step sets the rest, each forward pass: which rows compress (due, compressing, compress_args, keep_n,
        # holes_after), whether the layers remember the query (remembering), block top-k's pages (top, top_k, plan_pages)

    def start_step(self, positions):
        """Announce the next forward pass: positions [B, q] of its tokens (-1 for padding); the prompt, then q = 1.

        Decides on the host which rows compress at this step (`due`, `compress_args`), whether the layers remember
        the step's query (`remembering`) and, for block top-k, how many pages each row attends (`top`).
        Each row counts its own tokens, so a row's rollout does not depend on how long the other prompts
        of its batch are. A decode step feeds one real token per row, so it reads nothing back from the
        device; the prefill reads its rows' real-token counts once.
        """
        sparse, q = self.sparse, positions.shape[1]
        if self.layers and q != 1:   # a prefill's rules (no compression, every head's slots alike) would not hold
            raise ValueError(f"a step after the prefill feeds 1 token per row, got {q}")
        self.step_pos, self.decoding = positions, bool(self.layers)
        real = 1 if self.decoding else (positions >= 0).sum(1).cpu()
        self.padded = not self.decoding and bool((real < q).any())
        self.row_tokens = self.row_tokens + real                       # [B] real tokens held per row
        self.context = self.context + real                             # [B] ... and seen (the dense count)
        if sparse.schedule is not None:                                # section 6: grows with the context
            self.budget = sparse.schedule(self.context)
        # Prefill is kept whole; once over budget, a row compresses every `interval` decode steps.
        over = self.row_tokens - self.budget
        evicts = self.decoding and sparse.policy not in ("full", "blocktopk")
        self.due = (over >= sparse.interval) & evicts                 # interval >= 1: over budget
        # SnapKV and R-KV score with the last `window` queries before a compression: a decode step further than
        # that from every row's next one need not remember its query (2 launches a layer, eager). A step that
        # does not remember writes no query (the ring's index still turns, as in static.py), so the `window` steps
        # before a compression fill the ring whole.
        # A schedule may lower the budget, bringing compressions forward: with one, every step remembers.
        self.remembering = sparse.policy in ("snapkv", "rkv") and (
            not self.decoding or sparse.schedule is not None or bool((over + sparse.window > sparse.interval).any()))
        self.row_tokens = torch.where(self.due, self.budget, self.row_tokens)
        self.compressing = bool(self.due.any())
        self.compressions += self.compressing
        if self.compressing:   # what every layer's compression needs, in one copy to the device
            rows = self.due.nonzero()[:, 0]
            # `random`'s salt: (seed, context) + layer * 65_537; hash32 reads it mod 2**32, so may the (64-bit) seed
            b, salt = len(rows), self.seed % 2 ** 32 * 1_000_003 + self.context[rows]
            args = to_device(torch.cat([rows, salt, self.row_tokens]), positions.device)
            self.compress_args = args[:b], args[b:2 * b], args[2 * b:]           # due rows, salt, count [B]
            self.keep_n = int(self.row_tokens.max())
            self.holes_after = bool((self.row_tokens < self.keep_n).any())
        self.dense_kv_tokens += q
        self.peak_kv_tokens = max(self.peak_kv_tokens, self.kv_tokens + q)
        if sparse.policy == "blocktopk" and self.decoding:             # pages attended per row, decided here once
            held = (self.context - 1) // sparse.page_size + 1           # for every layer of this step
            top = torch.as_tensor(self.budget) // sparse.page_size + held.clamp(max=RESERVED_PAGES)
            self.top, self.top_k = to_device(top, positions.device), int(top.max())
            self.plan_pages = None                                      # made by the step's first sparse layer

    def capacity(self, prompt_len):
        """Slots to preallocate: everything for `full` and `blocktopk`, else what the cache holds before compressing."""
        total, sparse = prompt_len + self.max_new_tokens, self.sparse
        if sparse.policy in ("full", "blocktopk"):
            return total
        return min(total, max(prompt_len + 1, sparse.largest_budget + sparse.interval))

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Called by the model: store new keys and values [B, H_kv, q, D]; return the kept ones."""
        if layer_idx == len(self.layers):
            if not self.layers:   # the record is steps x layers x H_kv x S positions a row (Qwen3-1.7B, 4096 new
                # tokens, S = 512 + 128: 1.2 GB in int16, a quarter of int64's): int16 while the last position fits
                last = key_states.shape[2] + self.max_new_tokens - 1
                self.record_dtype = torch.int16 if last <= torch.iinfo(torch.int16).max else torch.int32
            # The buffers take the values' dtype: under bf16 autocast, rotary turns the keys fp32 while the values,
            # and what attention reads, are bf16. Keys stored as they come would double the cache's bytes.
            paged = self.sparse.policy == "blocktopk" and layer_idx >= self.sparse.dense_layers
            self.layers.append(Layer(value_states, self.capacity(key_states.shape[2]),
                                     self.sparse.page_size if paged else None, accumulate=self.sparse.policy == "h2o"))
            self.bytes_per_slot += 2 * value_states[:, :, :1].numel() * value_states.element_size()
        layer = self.layers[layer_idx]
        layer.append(key_states, value_states, self.step_pos)
        layer.holes = layer.holes or self.padded
        return layer.keys, layer.values

    def attend(self, layer_idx, query, scaling, sliding_window=None):
        """Called by the hook: compress if due, then attend. query [B, H, q, D] -> [B, H, q, D]."""
        layer, sparse = self.layers[layer_idx], self.sparse
        if self.remembering:
            layer.remember(query, self.step_pos, sparse.window)
        elif layer.queries is not None:   # the ring still turns (a host int), so a compression finds its queries
            layer.ring = (layer.ring + 1) % sparse.window   # in the slots every-step writing (static.py) gives them
        if self.compressing:
            rows, salt, count = self.compress_args
            compress(layer, sparse, rows, salt + layer_idx * 65_537, count, self.keep_n, scaling, sliding_window)
            layer.holes = self.holes_after
        # A decode step over real earlier tokens only sees every slot: no mask to build or apply.
        masked = not self.decoding or layer.holes or sliding_window is not None
        keys, values, key_pos = layer.keys, layer.values, layer.pos
        if layer.page_size and self.decoding:   # block top-k, past the dense layers (`update` gave it its pages)
            plan = self.plan_for(layer, self.top, self.top_k, layer.pos, self.step_pos, sliding_window)
            index, key_pos = top_pages(layer, query, plan, layer.pos)
            (keys, values), masked = layer.gather(index), True
        out, received = attention(query, keys, values, key_pos, self.step_pos, scaling, sliding_window,
                                  masked=masked, weights=sparse.policy == "h2o")
        if received is not None:  # H2O: what each key received, the mean over its group of query heads
            layer.acc_buf[:, :, : layer.size].add_(received.unflatten(1, (keys.shape[1], -1)).mean(2))
        if self.history is not None:
            self.history[layer_idx].append(key_pos.to(self.record_dtype, copy=True))
        return out

    def plan_for(self, layer, top, k, pos, query_pos, sliding_window):
        """Block top-k: the step's `policies.page_plan`, made by its first sparse layer and again by one whose
        sliding window differs (Qwen2's `layer_types` may mix full and sliding layers: the plan drops the pages
        past the window); the other layers reuse it."""
        if self.plan_pages is None or self.plan_pages.window != sliding_window:
            self.plan_pages = page_plan(layer.page_count, top, k, pos, self.sparse.page_size, query_pos, sliding_window)
        return self.plan_pages

    def get_seq_length(self, layer_idx=0):
        """The tokens fed before the step `start_step` announced, padding included (the model numbers its tokens
        from here when no position_ids come); not the slots held, which a compression lowers."""
        return self.dense_kv_tokens - (0 if self.step_pos is None else self.step_pos.shape[1])

    # slots currently held per layer and KV head; the peak and dense token counts in bytes
    kv_tokens = property(lambda self: self.layers[0].size if self.layers else 0)
    peak_kv_bytes = property(lambda self: self.peak_kv_tokens * self.bytes_per_slot)
    dense_kv_bytes = property(lambda self: self.dense_kv_tokens * self.bytes_per_slot)
