"""The eager and the static decode step side by side (static.py; docs/performance.md): tokens/s, ops a step,
every step's time, and where a step's time goes.

Random Llama weights of a given shape, greedy, each eager/static pair interleaved, the median of rounds. What a
step costs decides what eviction can save: an eager step on a GPU waits on Python and kernel launches, so
`--count-ops` counts what a step dispatches, `--step-times` times every eager step (synchronised) and splits the
mean into the steady step and the compressions, and `--profile` asks torch.profiler where the time goes.

    OMP_NUM_THREADS=1 python bench_static.py                # bench.py's model shape, on the CPU
    python bench_static.py --device cuda --shape qwen3-1.7b --batch 64 --prompt 512 --new 1536 --hf
    python bench_static.py --device cuda --shape qwen3-1.7b --batch 64 --prompt 512 --new 64 --rounds 1 --profile 64
    python bench_static.py --shape layers28 --batch 4 --prompt 64 --budget 32 --interval 16 --count-ops \\
        --policies full,streaming,snapkv,rkv,h2o,blocktopk                 # kernel launches a step, on the CPU
    python bench_static.py --device cuda --shape qwen3-1.7b --batch 64 --prompt 512 --new 320 --budget 512 \\
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
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from cli import check_least, check_values
from cost import QWEN3, kv_bytes
from kvcache import DENSE, POLICIES, KVCache, SparseConfig
from models import pick_device
from sampler import clock, generate


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
                with GCClock() as rollout:
                    s, c = step_times(model, prompts, configs[p], args.new)
                seconds[p] += s
                compressing[p] += c
                # counted with the rollout's steps: an interrupted rollout's collections go with its lost steps
                collector[p].seconds += rollout.seconds
                collector[p].full += rollout.full
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
        p90 = calm[-(-9 * len(calm) // 10) - 1]   # nearest rank: the ceil(0.9 n)-th smallest
        mean, vs = steady + compressions + spread, steady / parts[first][0] if parts[first][0] else float("nan")
        print(f"{p:>10}: mean step {mean:6.2f} ({mean / sum(parts[first]):.2f}x {first}'s) = steady median "
              f"{steady:6.2f} ({vs:.2f}x) + compressions {compressions:5.2f} ({sum(compressing[p])} steps, median "
              f"{statistics.median(each):7.2f}) + the steady steps' spread {spread:5.2f} (p90 "
              f"{p90:6.2f}, max {calm[-1]:7.2f}); garbage collector "
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
                   help="then profile a STEPS-token rollout per policy, eager and captured (torch.profiler): the "
                        "prefill and STEPS - 1 decode steps, their sums over STEPS shown as a step's")
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
        if args.profile == 1:                                         # its numbers "a step" would be the prefill's
            raise ValueError("--profile 1 profiles the prefill alone, no decode step: give 0 (no profile) or 2 or more")
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
