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
  step, as in the eager cache; so does a compression. A step at which any row compresses runs the
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

Speed, side by side in one run (random Llama weights, greedy, each pair interleaved, median of rounds):

    OMP_NUM_THREADS=1 python static.py                      # bench.py's model shape, on the CPU
    python static.py --device cuda --shape qwen3-1.7b --batch 64 --prompt 512 --new 1536 --hf
    python static.py --device cuda --shape qwen3-1.7b --batch 64 --prompt 512 --new 64 --rounds 1 --profile 64
    python static.py --shape layers28 --batch 4 --prompt 64 --budget 32 --interval 16 --count-ops \\
        --policies full,streaming,snapkv,rkv,h2o,blocktopk                 # kernel launches a step, on the CPU
    python static.py --device cuda --shape qwen3-1.7b --batch 64 --prompt 512 --new 320 --budget 512 \\
        --interval 128 --rounds 1 --policies full,h2o,snapkv,streaming,rkv --step-times   # each eager step timed
                                                                                        # (gpu_check.sh's)
"""
import argparse
import gc
import os
import statistics
import time
from unittest.mock import patch

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cost import QWEN3, kv_bytes
from kvcache import DENSE, POLICIES, KVCache, SparseConfig, attention
from policies import attended_pages, page_plan, top_pages

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
                        (policies.page_plan) is computed inside the graph from them
    seen    per layer   with record=True: the positions the step attended, cloned into `history`
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
                self.seen = [layer.pos_buf.new_full(self.seen_shape(layer), -1) for layer in self.layers]
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
            if self.plan_pages is None:     # the step's first sparse layer (start_step cleared it): in the graph
                self.plan_pages = page_plan(layer.page_count, self.pages, self.k_pages, key_pos, sparse.page_size)
            index, key_pos = top_pages(layer, query, self.plan_pages, key_pos)
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


# ----------------------------------------------------------------------------- eager vs static, side by side

WARM_UP = 8   # tokens of the untimed rollouts that run first (libraries' first calls, allocations)

SHAPES = {  # layers, hidden, heads, kv heads, ffn, vocab
    "bench": dict(num_hidden_layers=8, hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                  intermediate_size=1536, vocab_size=8192),
    "layers28": dict(num_hidden_layers=28, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=128, vocab_size=512),   # 1.7B's depth at toy width: the ops of its step
    "qwen3-1.7b": QWEN3["Qwen3-1.7B"],   # head_dim 128, tied embeddings
}


def profile(model, prompts, sparse, steps):
    """Where a decode step's time goes, eager against captured: torch.profiler over a `steps`-token rollout of each
    (the prefill included), its device-kernel time and kernel launches per step, and the ops that took the most."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from sampler import generate
    cuda = model.device.type == "cuda"
    for captured in (False, True):
        generate(model, prompts, sparse, max_new_tokens=steps, temperature=0, captured=captured)   # warm-up
        with torch.profiler.profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
            out = generate(model, prompts, sparse, max_new_tokens=steps, temperature=0, captured=captured)
        events = prof.key_averages()
        # the device's own rows (kernels, copies), as the table's "Self CUDA time total": the row of the op that
        # launched a kernel holds its time again (all rows summed: ~twice the kernels, 22.5 ms a step for 10.9)
        kernels = sum(e.self_device_time_total for e in events
                      if e.device_type != DeviceType.CPU and not e.is_user_annotation) / 1e3 / steps
        # cudaLaunchKernel, and the driver's cuLaunchKernel(Ex) that libraries such as cuBLAS may call instead
        launches = sum(e.count for e in events if "LaunchKernel" in e.key or e.key == "cudaGraphLaunch") / steps
        print(f"\n{sparse.policy}, {'captured' if captured else 'eager'}: {1e3 * out.stats['seconds'] / steps:.1f} ms a "
              f"step under the profiler, device kernels {kernels:.1f} ms a step, {launches:.0f} launches a step")
        print(events.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=12))


class OpCounter(TorchDispatchMode):
    """Counts the ops dispatched under it, views aside: on a GPU each is a kernel launch (or a copy), which is what
    bounds an eager step there. Under a CUDA graph a replay dispatches none; on the CPU the static step runs as it
    is, so its count is what the graph holds."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


def counted_steps(sparse, prompt):
    """The lengths of `ops_per_step`'s two rollouts: 2 and 3 intervals, and an evicting cache's budget past the
    prompt on top, so that the steps between them hold exactly one compression (the first comes at decode step
    budget + interval - prompt, the next an interval later), whatever the budget short of DENSE (never compresses)."""
    evicts = sparse.policy not in ("full", "blocktopk") and sparse.budget < DENSE
    skip = max(0, sparse.budget - prompt) if evicts else 0
    return skip + 2 * sparse.interval, skip + 3 * sparse.interval


def ops_per_step(model, prompts, sparse, captured):
    """Ops a decode step dispatches in the steady state: the count of a rollout `interval` steps longer, less the
    shorter one's, over `interval` (so one compression is spread over its interval, as in a long rollout).
    prompts: of one length (the command line's)."""
    from sampler import generate
    counts = []
    for steps in counted_steps(sparse, len(prompts[0])):
        with OpCounter() as counter:
            generate(model, prompts, sparse, max_new_tokens=steps, temperature=0, captured=captured)
        counts.append(counter.count)
    return (counts[1] - counts[0]) / sparse.interval


def step_times(model, prompts, sparse, steps):
    """Every eager decode step of a greedy `steps`-token rollout, timed on its own: -> (seconds [steps - 1],
    compressing [steps - 1] bools). A step runs from the cache's announcement of it (`start_step`) to the next
    one's, or to the rollout's end, on a synchronised clock. On a GPU each mark drains the queue, which a
    launch-bound eager step keeps short: the marks cost about a sync (~20 us) a step, not the step's overlap."""
    from sampler import clock, generate
    marks, start_step = [], KVCache.start_step

    def marked(cache, positions):
        now = clock(model.device)
        start_step(cache, positions)
        marks.append((now, cache.decoding, cache.compressing))
    with patch.object(KVCache, "start_step", marked):
        generate(model, prompts, sparse, max_new_tokens=steps, temperature=0)
    ends = [t for t, _, _ in marks[1:]] + [clock(model.device)]
    timed = [(end - t, compressing) for (t, decoding, compressing), end in zip(marks, ends) if decoding]
    return [seconds for seconds, _ in timed], [compressing for _, compressing in timed]


def split_mean(seconds, compressing):
    """The mean step, in three parts: -> (the median steady step, the compressing steps' excess over it and the
    other steps' excess over it, each spread over all steps). They sum to the mean; a large third part is a
    spread of the steady steps (outliers: pauses), not work that every step or every compression does. No steady
    step (every step compressed: interval 1 over budget): the median steady step is 0 and the mean is compressions."""
    steady = statistics.median([s for s, c in zip(seconds, compressing) if not c] or [0.0])
    excess = lambda which: sum(s - steady for s, c in zip(seconds, compressing) if c == which) / len(seconds)
    return steady, excess(True), excess(False)


class GCClock:
    """The seconds Python's garbage collector ran and its full (generation 2) collections while this was active,
    summed over every `with`. In an eager step bound by the host, a pause of the host is a pause of the GPU's queue."""

    def __init__(self):
        self.seconds, self.full, self.started = 0.0, 0, 0.0

    def __enter__(self):
        gc.callbacks.append(self.tick)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self.tick)

    def tick(self, phase, info):
        if phase == "start":
            self.started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self.started
            self.full += info["generation"] == 2


def print_step_times(model, prompts, configs, args):
    """`--step-times`: each policy's eager rollouts (`configs`: {policy: SparseConfig}), the policies taking turns
    round after round (so that no policy always runs first or last), every decode step timed (`step_times`); per
    policy the median steady step, the compressing steps, the mean step split as `split_mean` does, and the garbage
    collector's share."""
    policies = list(configs)
    print(f"{args.shape}, {model.dtype}, {model.device}, batch {args.batch}, prompt {args.prompt} + {args.new} new, "
          f"budget {args.budget}, interval {args.interval}; eager decode steps in ms, {args.rounds} rounds interleaved")
    seconds, compressing = {p: [] for p in policies}, {p: [] for p in policies}
    collector = {p: GCClock() for p in policies}
    for p in policies:                                                  # warm-up
        step_times(model, prompts, configs[p], WARM_UP)
    try:
        for _ in range(args.rounds):
            for p in policies:
                with collector[p]:
                    s, c = step_times(model, prompts, configs[p], args.new)
                seconds[p] += s
                compressing[p] += c
    except KeyboardInterrupt:   # a time limit's SIGINT (gpu_check.sh): the rollouts that finished, not nothing
        policies = [p for p in policies if seconds[p]]
        if not policies:
            raise
        print(f"interrupted: only the policies whose rollouts finished: {', '.join(policies)}")
    first = policies[0]
    parts = {p: [1e3 * x for x in split_mean(seconds[p], compressing[p])] for p in policies}
    for p in policies:
        steady, compressions, spread = parts[p]
        ms = lambda which: sorted(1e3 * s for s, c in zip(seconds[p], compressing[p]) if c == which) or [0.0]
        calm, each = ms(False), ms(True)
        mean, vs = steady + compressions + spread, steady / parts[first][0] if parts[first][0] else float("nan")
        print(f"{p:>10}: mean step {mean:6.2f} ({mean / sum(parts[first]):.2f}x {first}'s) = steady median "
              f"{steady:6.2f} ({vs:.2f}x) + compressions {compressions:5.2f} ({sum(compressing[p])} steps, median "
              f"{statistics.median(each):7.2f}) + the steady steps' spread {spread:5.2f} (p90 "
              f"{calm[int(0.9 * len(calm))]:6.2f}, max {calm[-1]:7.2f}); garbage collector "
              f"{1e3 * collector[p].seconds / len(seconds[p]):4.2f} a step, {collector[p].full} full collections")


def check_cache_fits(config, batch, prompt, new, configs, dtype, device):
    """A ValueError naming the sizes when the KV cache that a policy of `configs` preallocates at the prefill, for
    rollouts of up to `new` tokens, exceeds the device's memory: `KVCache.capacity` slots (full and block top-k:
    prompt + new; an evicting cache: budget + interval, the prompt whole at least), 2 x layers x kv heads x head
    dim x batch x slots, read from the model's `config` (its head_dim as Hugging Face sets it, the one attention
    uses). Found now, not as an allocator's traceback (or minutes of swapping) once a model is built."""
    slots, policy = max((KVCache(sparse, 1, new).capacity(prompt), policy) for policy, sparse in configs.items())
    need = kv_bytes(config, slots, batch, dtype.itemsize)
    has = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else
           os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else float("inf"))
    if need > has:
        raise ValueError(f"--batch {batch} x --prompt {prompt} + {new} new tokens: the KV cache {policy} preallocates "
                         f"({slots} slots a row) is {need / 2**30:.0f} GiB in {dtype}, and this {device.type} has "
                         f"{has / 2**30:.0f} GiB")


def main(argv=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    from cli import check_least, check_values
    from models import pick_device
    from sampler import clock, generate
    p = argparse.ArgumentParser(description="tokens/s of the eager and the static decode path, side by side",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (CUDA if torch sees a GPU)")
    p.add_argument("--shape", default="bench", choices=SHAPES, help="the random Llama's shape (SHAPES)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="none given: float32 on the CPU, bfloat16 on a GPU")
    p.add_argument("--batch", type=int, default=8, help="rows decoded together")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens (random ids)")
    p.add_argument("--new", type=int, default=512, help="tokens generated a rollout")
    p.add_argument("--budget", type=int, default=256,
                   help="tokens an evicting cache keeps (block top-k: in the pages it attends)")
    p.add_argument("--interval", type=int, default=128, help="decode steps between compressions")
    p.add_argument("--policies", default="full,snapkv,blocktopk", help="comma-separated: " + ", ".join(POLICIES))
    p.add_argument("--rounds", type=int, default=2, help="timed rollouts a policy and path (the median is shown)")
    p.add_argument("--hf", action="store_true", help="also time Hugging Face generate (dense, greedy)")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="then profile a STEPS-token rollout per policy, eager and captured (torch.profiler)")
    p.add_argument("--count-ops", action="store_true",
                   help="only count the ops (kernel launches on a GPU) of a decode step per policy, eager and static")
    p.add_argument("--step-times", action="store_true",
                   help="only time every eager decode step (synchronised), policies interleaved for --rounds rounds: "
                        "the steady step and the compressing steps per policy")
    args = p.parse_args(argv)
    given = [f"--{name.replace('_', '-')}" for name in ("count_ops", "step_times", "hf", "profile")
             if getattr(args, name)]
    if (args.count_ops or args.step_times) and len(given) > 1:        # else all but one silently dropped
        p.error(f"--count-ops and --step-times are runs of their own, each alone: got {' '.join(given)}")
    try:                                                              # every check before a model is built
        check_values(args, unchecked=("budget", "interval"))          # SparseConfig's: up to DENSE, never evicts
        check_least(args, 1, ["batch", "prompt", "new", "budget", "interval", "rounds"])
        check_least(args, 0, ["profile"], notes=dict(profile="0: no profile"))
        if args.step_times and args.new < 2:                          # the prefill samples the first token
            raise ValueError(f"--step-times times decode steps, and --new {args.new} has none: give --new 2 or more")
        device = pick_device(args.device)
        configs = {policy: SparseConfig(policy, budget=args.budget, interval=args.interval)
                   for policy in args.policies.split(",")}                # a policy named twice runs once
        dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
        counted = [counted_steps(sparse, args.prompt)[1] for sparse in configs.values()] if args.count_ops else []
        new = max(args.new, args.profile, WARM_UP, *counted)           # the longest rollout this run decodes
        config = LlamaConfig(max_position_embeddings=args.prompt + new + 1, **SHAPES[args.shape])
        check_cache_fits(config, args.batch, args.prompt, new, configs, dtype, device)
    except (RuntimeError, ValueError) as error:
        p.error(str(error))
    torch.manual_seed(0)
    with torch.device(device):   # initialised where it runs: a 2B model takes ~25 s to initialise on a CPU
        model = LlamaForCausalLM(config)
    model = model.to(dtype).eval()
    ids = torch.randint(1, config.vocab_size, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))
    prompts = ids.tolist()
    if args.count_ops:
        print(f"{args.shape}, {dtype}, {device}, batch {args.batch}, prompt {args.prompt}, budget {args.budget}, "
              f"interval {args.interval}; ops a decode step, views aside")
        for policy, sparse in configs.items():
            eager, static = (ops_per_step(model, prompts, sparse, captured) for captured in (False, True))
            print(f"{policy:>10}: {eager:7.1f} ops a decode step eager, {static:7.1f} static (a compression spread "
                  f"over its {args.interval} steps)")
        return
    if args.step_times:
        print_step_times(model, prompts, configs, args)
        return
    print(f"{args.shape}, {dtype}, {device}, batch {args.batch}, prompt {args.prompt} + {args.new} new, "
          f"budget {args.budget}, interval {args.interval}, {torch.get_num_threads()} threads; tokens/s, median of {args.rounds}")
    if args.hf:
        ids = ids.to(device)
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=WARM_UP,
                       min_new_tokens=WARM_UP)
        seconds = []
        for _ in range(args.rounds):
            start = clock(device)
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=args.new,
                           min_new_tokens=args.new, pad_token_id=0)
            seconds.append(clock(device) - start)
        print(f"HF generate, dense: {args.batch * args.new / statistics.median(seconds):.1f}")
    for policy, sparse in configs.items():
        speed = {False: [], True: []}
        for captured in (False, True):                                   # warm-up
            generate(model, prompts, sparse, max_new_tokens=WARM_UP, temperature=0, captured=captured)
        for _ in range(args.rounds):
            for captured in (False, True):
                out = generate(model, prompts, sparse, max_new_tokens=args.new, temperature=0, captured=captured)
                speed[captured].append(out.stats["tokens_per_s"])
        eager, static = statistics.median(speed[False]), statistics.median(speed[True])
        paired = statistics.median(b / a for a, b in zip(speed[False], speed[True]))   # robust to a slow round
        print(f"{policy:>10}: eager {eager:8.1f}  static {static:8.1f}  static / eager {static / eager:.2f}x, "
              f"median of the pairs' ratios {paired:.2f}x  "
              f"(rounds: {', '.join(f'{a:.1f}/{b:.1f}' for a, b in zip(speed[False], speed[True]))})")
    for sparse in configs.values() if args.profile else []:
        profile(model, prompts, sparse, args.profile)


if __name__ == "__main__":
    main()
