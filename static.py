"""A decode step whose shapes never change, so that a GPU replays it from a CUDA graph (docs/performance.md).

Why: eager decoding of a batch is bound by Python and kernel launches, not by the GPU. On an H100
(Qwen3-1.7B shape, batch 64, prompt 512 + 1536 new) an eager step took ~41 ms for `sampler.generate`
(~120 ms for Hugging Face `generate`; results/bench_gpu.md), while its memory traffic (~3.4 GB of weights plus the
KV cache) takes ~4 ms at ~3 TB/s; eviction cannot show in a step that waits on the host. gpt-fast's
remedy: a cache whose shapes never change, so one step is captured once and replayed, a few hundred
launches for the price of one.

How, here:
- `StaticCache` is `kvcache.KVCache` with the same preallocated buffers (`budget + interval` slots
  for eviction, `prompt + max_new_tokens` for full and blocktopk). A decode step writes its key at a
  slot held in a device tensor (`cursor`), and attends over the first `span` slots under the mask of
  their positions (-1: empty, padding or evicted). Block top-k scores every page of the span and
  gathers a fixed number of pages. Nothing in a step reads a host int that changes from step to step.
- `span` is the slots held, rounded up to a multiple of SPAN: a growing dense cache reads about what
  it holds (gpt-fast reads its whole buffer at every step: 1.5x the mean context of a rollout that
  triples its prompt), at the price of one graph per span, a capture every SPAN steps.
- The host's bookkeeping (`start_step`: which rows compress, budgets, pages per row) runs before the
  step, as in the eager cache. A step at which any row compresses runs the
  eager path itself, in the same buffers: its scores need that step's own query and key, made inside
  the forward pass, and which slots survive is data. Every `interval` steps per row (all rows at once
  when the prompts share a length, as in the benchmark; rows with ragged prompts fall due apart).
- `capture` replays the step from a `torch.cuda.CUDAGraph`; elsewhere it runs the step as it is,
  which is how the CPU tests check it (and tests/test_static.py traces it with torch.compile,
  fullgraph, to prove nothing in it breaks a capture).

What is equal to what: the static cache keeps exactly the eager cache's tokens (the same scores over
the same packed slots; the compressions are the same code). Its attention runs over more, masked
slots, so log-probs agree to rounding (~1e-7 in fp32), and tokens agree unless two are within rounding
of each other. Sampling draws the same noise in both paths (`sampler.sample_token`), so a seeded run
samples the same tokens.

    out = generate(model, prompts, SparseConfig("snapkv", budget=512), captured=True)   # sampler.py

Speed, eager against this step side by side: bench_static.py.
"""
import torch

from hook import attention
from kvcache import KVCache
from policies import attended_pages, top_pages

# A step reads the held slots rounded up to a multiple of SPAN (or the whole buffer, if shorter): at 512 + 1536,
# 64 slots more than it holds on average, one graph captured per 128 steps; a multiple of 16 keeps the attention
# mask aligned as SDPA's memory-efficient kernel wants it (else it pads the mask at every layer).
SPAN = 128


class StaticCache(KVCache):
    """`KVCache` whose decode steps keep their shapes; prefill and compressing steps run the eager cache.

    Device state of a static step (all allocated once, after the prefill):
    cursor  [1] long    the slot the step's new key is written to (every layer holds the same slots)
    ring    [1] long    the window's slot for the step's query (SnapKV, R-KV): `Layer.ring`'s device twin
    now     [B, 1]      the step's positions, copied in by `start_step`
    pages   [B] long    blocktopk: `KVCache.top` copied in (pages attended per row at this step); `k_pages`, a
                        fixed bound on `top_k`, is the ranks a step gathers; the step's `plan_pages`
                        (`KVCache.plan_for`: policies.page_plan) is computed inside the graph from them
    seen    per layer   with record=True: the positions the step attended (`record_dtype`), cloned into `history`
    The host keeps `Layer.size` and `Layer.ring` in step (`end_step`), so an eager step can follow,
    and sets `span` (an int: the slots a step reads), which changes every SPAN steps of a growing cache.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.static = False      # whether the announced step runs the static path
        self.cursor = None       # the device state, made after the prefill

    def start_step(self, positions):
        """The eager cache's bookkeeping; then, for a static step, its inputs copied into the device state."""
        super().start_step(positions)
        resuming = not self.static
        self.static = self.decoding and not self.compressing
        if not self.static:
            return
        self.layers[0].check_room(1)   # the step writes at `cursor` unchecked (past the buffers: a GPU's device assert)
        if resuming:             # after the prefill or a compression, the host's layout is the truth
            self.resume()
        self.now.copy_(positions)
        held = self.layers[0].size + 1                                   # with this step's own key
        self.span = min(self.layers[0].pos_buf.shape[-1], -(-held // SPAN) * SPAN)
        if self.sparse.policy == "blocktopk":
            self.pages.copy_(self.top)

    def resume(self):
        """Set the device state from the host's: where the next key goes, which slots are empty."""
        first, sparse = self.layers[0], self.sparse
        if self.cursor is None:
            device, B = first.k_buf.device, first.k_buf.shape[0]
            self.cursor = torch.zeros(1, dtype=torch.long, device=device)
            self.ring = torch.zeros(1, dtype=torch.long, device=device)
            self.now = torch.zeros(B, 1, dtype=torch.long, device=device)
            self.pages = torch.zeros(B, dtype=torch.long, device=device)
            # blocktopk attends to at most the largest budget's pages + the reserved ones, of those that exist
            self.k_pages = min(attended_pages(sparse.largest_budget, sparse.page_size),
                               (first.pos_buf.shape[-1] - 1) // sparse.page_size + 1)
            if self.history is not None:
                self.seen = [layer.pos_buf.new_full(self.seen_shape(layer), -1, dtype=self.record_dtype)
                             for layer in self.layers]
        self.cursor.fill_(first.size)
        self.ring.fill_(first.ring)
        for layer in self.layers:
            layer.pos_buf[:, :, layer.size:] = -1    # a compression left old positions past the kept slots

    def seen_shape(self, layer):   # a paged layer (block top-k, past the dense ones) gathers k_pages pages
        return (*layer.pos_buf.shape[:2], self.k_pages * layer.page_size if layer.page_size else layer.pos_buf.shape[2])

    # the step (traced, captured): tensors in place, no host ints that change

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Called by the model: write the new key and value [B, H_kv, 1, D] at `cursor`; -> the span's slots."""
        if not self.static:
            return super().update(key_states, value_states, layer_idx)
        layer = self.layers[layer_idx]   # under autocast keys come out fp32 (rotary), values bf16: one buffer dtype
        layer.k_buf.index_copy_(2, self.cursor, key_states.to(layer.k_buf.dtype))
        layer.v_buf.index_copy_(2, self.cursor, value_states.to(layer.v_buf.dtype))
        layer.pos_buf.index_copy_(2, self.cursor, self.now[:, None].expand(-1, key_states.shape[1], -1))
        if layer.acc_buf is not None:
            layer.acc_buf.index_fill_(2, self.cursor, 0.0)
        if layer.page_size:
            layer.add_pages(key_states, self.now)
        return layer.k_buf[:, :, :self.span], layer.v_buf[:, :, :self.span]

    def attend(self, layer_idx, query, scaling, sliding_window=None):
        """Called by the hook: attend over the span's slots, masked by position. query [B, H, 1, D] -> [B, H, 1, D]."""
        if not self.static:
            return super().attend(layer_idx, query, scaling, sliding_window)
        layer, sparse = self.layers[layer_idx], self.sparse
        if sparse.policy in ("snapkv", "rkv"):   # every step: a graph cannot ask `remembering` (same slots as eager)
            layer.queries.index_copy_(2, self.ring, query)
            layer.query_pos.index_copy_(1, self.ring, self.now)
        span = slice(0, self.span)
        keys, values, key_pos = layer.k_buf[:, :, span], layer.v_buf[:, :, span], layer.pos_buf[:, :, span]
        if layer.page_size:                     # block top-k, past the dense layers (`KVCache.update`)
            plan = self.plan_for(layer, self.pages, self.k_pages, key_pos, self.now, sliding_window)   # in the graph
            index, key_pos = top_pages(layer, query, plan, key_pos)
            keys, values = layer.gather(index)
        out, received = attention(query, keys, values, key_pos, self.now, scaling, sliding_window,
                                  weights=sparse.policy == "h2o")
        if received is not None:  # H2O: what each key received, the mean over its group of query heads
            layer.acc_buf[:, :, span].add_(received.unflatten(1, (keys.shape[1], -1)).mean(2))  # in place: no copy back
        if self.history is not None:   # a span (or, blocktopk, its pages) may be shorter than `seen`
            seen = self.seen[layer_idx]
            seen[..., :key_pos.shape[-1]].copy_(key_pos)
            seen[..., key_pos.shape[-1]:].fill_(-1)
        if layer_idx == self.num_layers - 1:      # every layer wrote at `cursor`: the next step writes past it
            self.cursor.add_(1)
            self.ring.copy_((self.ring + 1) % sparse.window)
        return out

    def end_step(self):
        """After a static step, on the host: what it changed (one more slot held, one more query
        remembered), and with record=True what it attended."""
        for layer_idx, layer in enumerate(self.layers):
            layer.size += 1
            if layer.queries is not None:
                layer.ring = (layer.ring + 1) % self.sparse.window
            if self.history is not None:
                self.history[layer_idx].append(self.seen[layer_idx].clone())


def capture(step, cache):
    """`step(token, positions, noise)` as a static step runs: from a CUDA graph on a GPU, as it is elsewhere.

    On CUDA the first static step runs plainly on a side stream (it warms up the libraries a capture must
    not initialise); the first step of each `cache.span` is captured into a graph of its own, and every
    later step of that span replays it: the inputs are copied into the graphs' tensors, the outputs cloned
    out of their pool. The graphs share one memory pool: one runs at a time, and no graph's output is read
    after another has run. `cache.end_step()` follows each step.
    """
    graphs, outputs, inputs, pool = {}, {}, None, None

    def run(*args):
        nonlocal inputs, pool
        device, span = args[0].device, cache.span
        if device.type != "cuda":
            out = step(*args)
        elif inputs is None:                          # the warm-up: a real step, on a side stream
            inputs = [a if a is None else a.clone() for a in args]
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                out = step(*args)
            torch.cuda.current_stream(device).wait_stream(stream)
        else:
            for mine, given in zip(inputs, args):
                if given is not None:
                    mine.copy_(given)
            if span not in graphs:                    # capture records the kernels, runs none of them
                graphs[span] = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graphs[span], pool=pool):
                    outputs[span] = step(*inputs)
                pool = graphs[span].pool()
            graphs[span].replay()
            out = tuple(o.clone() for o in outputs[span])
        cache.end_step()
        return out

    return run
