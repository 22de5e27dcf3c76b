"""Sparsity schedules: the budget as a function of the context length (docs/method.md sections 3, 4, 6).

A fixed budget is too aggressive late in a long generation (the acceptance's tail falls as the context grows) or
too lenient early. Sparrow keeps the 5th percentile of `alpha_t = 1 - TV(p_dense, p_sparse)` in each length bin
above a threshold (0.86) with a piecewise-constant budget that grows with the context, found offline per bin.

What is notable here:
- `Schedule` is a callable `context length -> budget` that the cache (`kvcache.SparseConfig(schedule=...)`)
  asks at every decode step; `None` in a bin means dense.
- `calibrate` is Sparrow's offline profiling; controller.py holds the online variant (ours, not in the paper).
- `--speedup` prices a schedule with cost.py's per-step cost model (section 6, after Kinetics) on Qwen3 shapes.

    python train.py --steps 0 && python schedule.py --calibrate   # on out/warmup (train.py's); writes out/schedule.json
    python schedule.py --speedup results/schedule.json --context 32768     # Qwen3-1.7B/4B/8B
"""
import argparse
import json
import math
from contextlib import nullcontext
from dataclasses import dataclass, replace
from itertools import accumulate
from pathlib import Path

import numpy as np
import torch

import distill
import tasks
from cli import check_dense_layers, check_evicts, check_least, check_out_file, check_values, markdown
from correction import acceptance, dense_logprobs  # alpha = sum_v min(p_a, p_b) (section 4)
from cost import QWEN3, speedup_table
from kvcache import DENSE, POLICIES, SparseConfig
from models import DTYPES, autocast, load_pretrained, pick_device, toy_settings, write_text_atomically
from policies import attended_pages
from sampler import check_length, generate

THRESHOLD = 0.86  # Sparrow: runs whose 5th-percentile acceptance stayed >= 0.86 trained stably


# ----------------------------------------------------------------------------- the schedule

@dataclass(frozen=True)
class Schedule:
    """A piecewise-constant budget: `budgets[i]` holds for contexts in [bins[i], bins[i + 1]).

    bins     first context length of each bin: starts at 0, strictly increasing
    budgets  tokens per bin (int), or None: dense, evict nothing in that bin
    """

    bins: tuple
    budgets: tuple

    def __post_init__(self):
        bins, budgets = tuple(self.bins), tuple(self.budgets)
        object.__setattr__(self, "bins", bins)
        object.__setattr__(self, "budgets", budgets)
        if len(bins) == 0 or len(bins) != len(budgets):
            raise ValueError(f"need one budget per bin, got {len(bins)} bins and {len(budgets)} budgets")
        whole = lambda b: isinstance(b, int) and not isinstance(b, bool) and b <= DENSE   # JSON's true is no 1
        if bins[0] != 0 or not all(map(whole, bins)):
            raise ValueError(f"bins must be integers starting at 0, up to 2**40, got {list(bins)}")
        if any(b >= c for b, c in zip(bins, bins[1:])):
            raise ValueError(f"bins must be strictly increasing, got {list(bins)}")
        if any(b is not None and not (whole(b) and b >= 1) for b in budgets):
            raise ValueError(f"budgets must be positive integers or None (dense), at most 2**40, got {list(budgets)}")

    def __call__(self, context):
        """Budget at `context` tokens: an int for an int, a long tensor [B] for a tensor [B] (dense = DENSE)."""
        values = torch.tensor([DENSE if b is None else b for b in self.budgets])
        index = torch.bucketize(torch.as_tensor(context).cpu(), torch.tensor(self.bins), right=True) - 1
        out = values[index]
        return int(out) if isinstance(context, int) else out.to(torch.as_tensor(context).device)

    def scaled(self, factor):
        """The same shape at `factor` times the lengths: every bin start and budget multiplied, rounded."""
        return Schedule(tuple(round(b * factor) for b in self.bins),
                        tuple(None if b is None else min(DENSE, max(1, round(b * factor))) for b in self.budgets))

    def save(self, path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, json.dumps({"bins": list(self.bins), "budgets": list(self.budgets)}) + "\n")

    @staticmethod
    def load(path):
        """A schedule from a JSON file {"bins": [...], "budgets": [...]}; ValueError naming the file otherwise."""
        try:
            data = json.loads(Path(path).read_text())
            if not isinstance(data, dict):
                raise ValueError(f'it holds a {type(data).__name__}, not {{"bins": [...], "budgets": [...]}}')
            return Schedule(data["bins"], data["budgets"])
        except KeyError as e:
            raise ValueError(f"cannot read a schedule from {path}: no key {e} (it needs \"bins\" and \"budgets\")") from None
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"cannot read a schedule from {path}: {e}") from None


def constant(budget):
    """The same budget at every length (Sparse-RL's fixed budget)."""
    return Schedule((0,), (budget,))


piecewise = Schedule   # Sparrow's schedule under its name in the paper: `budgets[i]` from context `bins[i]` on


# ----------------------------------------------------------------------------- measuring the tail

def check_bins(bin_size, q, threshold=None):
    """A ValueError naming the bad value unless bin_size is a positive integer and the quantile q and the tail's
    threshold (if given) lie in [0, 1]."""
    if threshold is not None and not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must lie in [0, 1], got {threshold}")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must lie in [0, 1], got {q}")
    if not isinstance(bin_size, int) or bin_size < 1:
        raise ValueError(f"bin_size must be a positive integer, got {bin_size!r}")


def tail_by_bin(alpha, positions, bin_size, q=0.05):
    """The q-quantile of the acceptance per length bin (section 4: the paper's tail statistic).

    alpha, positions: same shape (e.g. [N, T]); positions = context length when the token was
    sampled, -1 for tokens to ignore (padding). Bin i holds contexts [i * bin_size, (i + 1) * bin_size).
    Returns (tails [n_bins] float64, nan where a bin is empty; counts [n_bins] long), n_bins = the
    largest real position // bin_size + 1 (0 when no token is real): no empty trailing bin.
    """
    check_bins(bin_size, q)
    real = positions >= 0
    alpha, which = alpha[real].double().cpu().numpy(), (positions[real] // bin_size).cpu()
    n = int(which.max()) + 1 if which.numel() else 0
    counts = torch.bincount(which, minlength=n)
    tails = torch.full((n,), float("nan"), dtype=torch.float64)
    # np.quantile interpolates linearly as torch.quantile does, which raises past 2^24 values: a bin of 16.8M tokens
    # (8192 responses through one of Sparrow's 2K-token bins) stopped the run, as in correction.mismatch_stats
    for i in counts.nonzero()[:, 0].tolist():
        tails[i] = np.quantile(alpha[(which == i).numpy()], q)
    return tails, counts


def by_bin(alpha, positions, schedule, bin_size, interval=1, q=0.05):
    """What the blame rule reads from one batch sampled under `schedule` (bins of `bin_size` from 0), per bin;
    contexts past the last bin count in it (its budget holds there).

    alpha, positions: [N, T], positions = the context each token was sampled at (-1: ignore).
    Returns (tails [n] float64, nan where empty; counts [n]; longest [n] context, -1 where none;
    compressed: the sorted bins where the cache compressed some row, `compressed_bins`), n = len(schedule.bins).
    """
    alpha, positions = alpha.cpu(), positions.cpu()                  # measure's are on the model's device
    n, real = len(schedule.bins), positions >= 0
    which = (positions[real] // bin_size).clamp(max=n - 1)
    tails = tail_by_bin(alpha[real], which * bin_size, bin_size, q)[0]                # up to the last bin with a token
    tails = torch.cat([tails, torch.full((n - len(tails),), float("nan"), dtype=torch.float64)])
    longest = torch.full((n,), -1, dtype=torch.long).scatter_reduce(0, which, positions[real], "amax")
    return tails, torch.bincount(which, minlength=n), longest, compressed_bins(positions, schedule, bin_size, interval)


def compressed_bins(positions, schedule, bin_size, interval=1):
    """The bins in which the cache compressed some row: `KVCache.start_step`'s rule replayed from the contexts.

    positions [N, T]: each row's response sampled at contexts P .. its last (-1 after). The prefill keeps the
    P-token prompt; each decode step adds a token at context c and, once the row holds schedule(c) + interval
    tokens, keeps schedule(c). What a row holds, not its context, decides: a bin whose budget covers what the row
    still holds compresses nothing. -> sorted list of bins, c // bin_size (past the last bin of `schedule`: in it).
    """
    first, last = positions[:, 0].cpu(), positions.amax(1).cpu()        # -1 after the response: never the max
    held, hit = first, set()
    for t in range(1, int((last - first).max()) + 1 if len(first) else 0):
        c, live = first + t, first + t <= last
        held = held + live
        budget = schedule(c)
        due = live & (held - budget >= interval)
        held = torch.where(due, budget, held)
        hit.update((c[due] // bin_size).clamp(max=len(schedule.bins) - 1).tolist())
    return sorted(hit)


def blamed_bin(i, budgets, longest, compressed, page_size=None, seen=None):
    """The bin whose budget rises when bin i's tail fails, or None: nothing to raise.

    budgets: per bin (None: dense); longest: each bin's longest context; compressed: the bins where the cache
    compressed (`compressed_bins`); seen: the bins measured, i among them (all if None).
    Eviction: i itself if the cache compressed in it; if not, what i misses was dropped earlier, for good, so the
    latest earlier bin where it compressed; None if it compressed in no bin up to i (eviction is not the cause).
    Block top-k (`page_size`): nothing is dropped for good, each step chooses its pages anew, so i itself if its
    longest context has more pages than a step attends (`policies.attended_pages`); else None."""
    if page_size:
        pages = (int(longest[i]) - 1) // page_size + 1
        return i if budgets[i] is not None and attended_pages(budgets[i], page_size) < pages else None
    return max([j for j in compressed if j <= i and (seen is None or j in seen)], default=None)


def measure(model, prompts, sparse, max_new_tokens, temperature=1.0, eos_token_id=None, pad_token_id=0, seed=0,
            adapter=None):
    """Sample with `sparse`, re-score densely -> (alpha [N, T], positions [N, T], -1 off the responses).

    The acceptance sums over the sampler's top-k ids as in training (section 4): the threshold means the same.
    With a DistillSparse `adapter` the sampler is theta + phi; the dense policy is always theta alone.
    """
    with adapter.on() if adapter else nullcontext():
        out = generate(model, prompts, sparse, max_new_tokens, temperature, eos_token_id=eos_token_id,
                       pad_token_id=pad_token_id, seed=seed)
    _, topk_dense = dense_logprobs(model, out, topk=True, temperature=temperature)
    return acceptance(topk_dense, out.topk_logprobs), token_contexts(out)


def bins_for(longest_prompt, max_new_tokens, bin_size):
    """How many length bins of `bin_size` cover every context a response token is sampled at: from 0 to the
    longest prompt plus `max_new_tokens` - 1. Sized from the prompt too: contexts are prompt + response, so
    bins sized from `max_new_tokens` alone put a 175-token prompt's whole response in the last bin."""
    return (longest_prompt + max_new_tokens - 1) // bin_size + 1


def token_contexts(rollouts):
    """The context length each response token was sampled at: [N, T], prompt length + t; -1 off the response."""
    contexts = torch.tensor([len(p) for p in rollouts.prompts])[:, None] + torch.arange(rollouts.tokens.shape[1])
    return contexts.to(rollouts.mask.device).masked_fill(rollouts.mask == 0, -1)


def bin_metrics(alpha, contexts, bin_size, schedule):
    """Per-step metrics by length bin: the tail of alpha [N, T] at `contexts` [N, T] (-1: ignore), the
    tokens, and the largest budget `schedule` (a Schedule or controller.Controller; None = dense) sets in each bin
    (None where it keeps everything). Lists, one entry per bin; a bin with no token has tail None."""
    tails, counts = tail_by_bin(alpha.cpu(), contexts.cpu(), bin_size)

    def largest(start, end):   # the budget only changes at the schedule's bin starts
        most = max(schedule(c) for c in [start] + [b for b in schedule.bins if start < b < end])
        return None if most >= DENSE else most

    return dict(bin_size=bin_size, tokens_by_bin=counts.tolist(),
                alpha_p05_by_bin=[None if math.isnan(t) else round(t, 4) for t in tails.tolist()],
                budget_by_bin=[None if schedule is None else largest(i * bin_size, (i + 1) * bin_size)
                               for i in range(len(tails))])


# ----------------------------------------------------------------------------- offline: Sparrow

def calibrate(model, prompts, candidates, threshold=THRESHOLD, bin_size=16, sparse=SparseConfig("snapkv"),
              max_new_tokens=64, q=0.05, **sampling):
    """The smallest candidate budget per length bin that keeps the tail >= threshold (section 6).

    Profiles each candidate held constant; a bin no candidate holds is dense (None). Budgets are made
    non-decreasing (eviction is irreversible: a long context never gets back what a short one dropped). A schedule
    evicts earlier than a constant budget, so it is re-measured, and the earliest bin blamed for a failing bin
    (`blamed_bin`, the controller's rule) moves to its next candidate, until every bin holds or none is to blame.
    Returns (Schedule, rows): per bin {bins, budget, tail, tokens} of the last measurement, and `profile`: its
    tail at each candidate held constant (nan: no token).
    `sampling`: temperature, eos_token_id, pad_token_id, seed (as `sampler.generate`), adapter (`measure`).
    """
    check_bins(bin_size, q, threshold)                                 # before the first generation
    if not candidates:
        raise ValueError(f"candidates must name at least one budget, got {candidates!r}")
    options = sorted(set(candidates)) + [None]                         # None: dense
    caches = [replace(sparse, budget=c, schedule=None) for c in options[:-1]]   # each checked before any sampling
    tails = [tail_by_bin(*measure(model, prompts, cache, max_new_tokens, **sampling), bin_size, q)[0]
             for cache in caches]
    n = max(len(t) for t in tails)
    tail = lambda i, k: float(tails[k][i]) if i < len(tails[k]) else float("nan")
    # smallest passing candidate per bin (an empty bin passes with anything)
    choice = [next((k for k in range(len(options) - 1) if not tail(i, k) < threshold), len(options) - 1)
              for i in range(n)]
    while True:
        choice = list(accumulate(choice, max))                        # running max: non-decreasing in the context
        budgets = [options[k] for k in choice]
        schedule = piecewise([i * bin_size for i in range(n)], budgets)
        alpha, positions = measure(model, prompts, replace(sparse, schedule=schedule), max_new_tokens, **sampling)
        measured, counts, longest, compressed = by_bin(alpha, positions, schedule, bin_size, sparse.interval, q)
        blamed = {blamed_bin(i, budgets, longest, compressed, sparse.pages)
                  for i in range(n) if measured[i] < threshold} - {None}
        if not blamed:
            break
        choice[min(blamed)] += 1                                      # one bin at a time, the earliest first
    rows = [dict(bins=(i * bin_size, (i + 1) * bin_size), budget=budgets[i], tail=float(measured[i]),
                 tokens=int(counts[i]), profile=[tail(i, k) for k in range(len(options) - 1)]) for i in range(n)]
    return schedule, rows


# ----------------------------------------------------------------------------- command line

def parse_args(argv=None):
    """The command line, every check made before any model loads -> (args, parser)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter,   # a short usage line:
                                usage="%(prog)s --calibrate [--flag value ...] | --speedup SCHEDULE.json   (--help: all)")
    g = p.add_argument_group("calibrate (Sparrow's offline profiling); the sampler's settings default to "
                             "those train.py uses for the warm-up's task")
    g.add_argument("--calibrate", action="store_true", help="profile candidate budgets per length bin")
    g.add_argument("--model", default="out/warmup", help="a toy warm-up folder (python train.py makes out/warmup) or "
                   "checkpoint; its warmup.json or args.json gives the task and digits of the prompts")
    g.add_argument("--adapter", metavar="FILE", help="a DistillSparse adapter.safetensors: sample with theta + phi")
    g.add_argument("--prompts", type=int, default=32, help="number of prompts")
    g.add_argument("--policy", default="snapkv", choices=[x for x in POLICIES if x != "full"],
                   help="the sampler's policy (full never evicts: nothing to calibrate)")
    g.add_argument("--candidates", default="6,8,10,12,14,16,20,24,28,32,40", help="budgets to try, comma-separated")
    g.add_argument("--threshold", type=float, default=THRESHOLD, help="tail acceptance to hold")
    for name, what in [("bin_size", "tokens per length bin"), ("interval", "decode steps between compressions"),
                       ("window", "newest tokens always kept"), ("sink", "first tokens streaming always keeps"),
                       ("max_new_tokens", "response length limit"), ("page_size", "blocktopk: tokens per page"),
                       ("dense_layers", "blocktopk: first layers that attend to everything")]:
        sparrow = {"page_size": "; --speedup: Sparrow's 16", "dense_layers": "; --speedup: Sparrow's 2"}.get(name, "")
        g.add_argument("--" + name.replace("_", "-"), type=int, help=f"{what} (none: train.py's for the task{sparrow})")
    g.add_argument("--out", default="out/schedule.json", help="where the schedule is written")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA if torch sees a GPU")
    g.add_argument("--dtype", default="float32", choices=list(DTYPES), help="precision of the forward passes, as "
                   "train.py's (bfloat16: under autocast)")
    g = p.add_argument_group("cost model (docs/method.md section 6)")
    g.add_argument("--speedup", metavar="SCHEDULE.json", help="predicted speedup of a schedule for Qwen3 shapes")
    g.add_argument("--context", type=int, default=32768, help="tokens generated")
    g.add_argument("--batch", type=int, default=64, help="rows decoded together")
    args = p.parse_args(argv)
    if not args.calibrate and args.speedup is None:
        p.error("give --calibrate and/or --speedup SCHEDULE.json")
    try:
        check_args(args)
    except ValueError as error:
        p.error(str(error))
    return args, p


def check_args(args):
    """Every bad value one clear ValueError, before any model loads; reads the --speedup schedule (`args.schedule`),
    the warm-up's settings (`args.warmup`, filling in the flags not given) and the sampler's (`args.sparse`)."""
    check_values(args)
    check_least(args, 1, ["prompts", "context", "batch", "bin_size", "interval", "window", "max_new_tokens",
                          "page_size"])
    check_least(args, 0, ["sink", "dense_layers"])                    # None: as train.py sets it
    if not 0.0 <= args.threshold <= 1.0:
        raise ValueError(f"--threshold must lie in [0, 1], got {args.threshold}")
    if args.context > 2 ** 20:         # --speedup sums every 64th decode step's cost: 10 s at 2**20, days at 10**11
        raise ValueError(f"--context must be at most 2**20 = 1048576 tokens, got {args.context}")
    pricing = args.speedup is not None                                 # (not `speedup`: the function's name)
    # --speedup's block top-k pages: Sparrow's where no flag is given, set before --calibrate fills in the toy's
    args.pages = {}
    if pricing and args.policy == "blocktopk":
        args.pages = dict(page_size=args.page_size or SparseConfig.page_size,
                          dense_layers=SparseConfig.dense_layers if args.dense_layers is None else args.dense_layers)
        layers = min((c["num_hidden_layers"], n) for n, c in QWEN3.items())
        check_dense_layers(args.pages["dense_layers"], *layers)        # every layer dense: 1.00x everywhere
    args.schedule = None                                               # the --speedup schedule, read once
    # else what --calibrate writes: one file however spelled (out/s.json, ./out/s.json, /abs/out/s.json)
    if pricing and not (args.calibrate and Path(args.speedup).resolve() == Path(args.out).resolve()):
        args.schedule = Schedule.load(args.speedup)                    # a bad file, named before a calibration
    if not args.calibrate:
        return
    try:
        args.candidates = sorted({int(c) for c in args.candidates.split(",")})
    except ValueError:
        raise ValueError(f"--candidates must be comma-separated integers, got {args.candidates!r}") from None
    if args.candidates[-1] > DENSE:
        raise ValueError(f"--candidates must be at most 2**40 (DENSE), got {args.candidates[-1]}")
    args.warmup = toy_settings(args.model)
    if args.warmup.get("model"):
        raise ValueError(f"{args.model!r} was trained from --model {args.warmup['model']}: --calibrate takes the toy "
                         "warm-up or a toy run's checkpoint (its prompts are the toy task's)")
    for name, value in tasks.TOY_TASKS[args.warmup["task"]].items():     # the run's settings where none given
        if getattr(args, name, 0) is None:
            setattr(args, name, value)
    if args.adapter is not None and not Path(args.adapter).is_file():
        raise ValueError(f"--adapter {args.adapter!r}: no such file")
    check_out_file(args.out)
    try:   # the sampler's settings, with the smallest candidate as its budget
        args.sparse = SparseConfig(args.policy, args.candidates[0], interval=args.interval, window=args.window,
                                   sink=args.sink, page_size=args.page_size, dense_layers=args.dense_layers)
    except ValueError as error:
        raise ValueError(f"{error} (the budget: the smallest of --candidates)") from None


def print_calibration(args, p):
    """`--calibrate`: profile the warm-up's prompts, print the table of tails per bin, write the schedule."""
    try:
        device = pick_device(args.device)
        model, tok = load_pretrained(args.model, device=device)
        adapter = distill.LoRA.from_file(model, args.adapter) if args.adapter else None
        examples = tasks.make_examples(args.warmup["task"], args.prompts, 0, *args.warmup["digits"])
        prompts = [tasks.encode_prompt(tok, e["prompt"]) for e in examples]
        check_length(max(map(len, prompts)), args.max_new_tokens, model.config)   # before the first candidate
        if args.policy == "blocktopk":
            check_dense_layers(args.dense_layers, model.config.num_hidden_layers)
        check_evicts("--candidates", args.candidates[0], args.policy, args.interval, max(map(len, prompts)),
                     args.max_new_tokens, args.sparse.pages)            # else each candidate "holds": a dense run
    except ValueError as error:
        p.error(str(error))
    candidates, threshold = args.candidates, args.threshold
    with autocast(args.dtype, device):
        schedule, rows = calibrate(model, prompts, candidates, threshold, args.bin_size, args.sparse,
                                   args.max_new_tokens, eos_token_id=tok.eos_token_id,
                                   pad_token_id=tok.pad_token_id or 0, adapter=adapter)
    cell = lambda t: "-" if math.isnan(t) else f"{t:.2f}"              # nan: the bin had no token
    span = lambda r: f"{r['bins'][0]}-{r['bins'][1] - 1}"
    header = ["context", *(f"at {c}" for c in candidates), "chosen", "tail", "tokens"]
    print(f"Tail alpha (p05) per context bin at each constant candidate budget ({args.policy}), then the chosen "
          f"budget (the smallest holding {threshold}, non-decreasing, raised where the whole schedule fell short) and "
          "the tail re-measured under the whole schedule\n\n" +
          markdown(header, [[span(r), *map(cell, r["profile"]), r["budget"] or "dense", cell(r["tail"]), r["tokens"]]
                            for r in rows]))
    below = [f"{span(r)} ({r['tail']:.2f})" for r in rows if r["tail"] < threshold]
    if below:   # calibrate stopped: no bin up to these evicts (or skips pages), so no budget can lift them
        print(f"below {threshold} with no bin to raise (none drops tokens: the mismatch is not the budget's): "
              + ", ".join(below))
    holds = [c for k, c in enumerate(candidates) if all(not r["profile"][k] < threshold for r in rows)]
    print(f"the smallest constant budget holding {threshold} in every bin: {holds[0] if holds else 'none'}")
    schedule.save(args.out)
    print(f"wrote {args.out}")
    return schedule


def print_speedup(args, schedule):
    """`--speedup`: the cost model's predicted speedup of `schedule` for the Qwen3 shapes, as a table."""
    # A toy schedule's budgets are tens of tokens; at 32K tokens the same budget/context ratios are
    # the fair comparison, so the schedule is also shown stretched from its last bin to --context.
    bins = schedule.bins
    end = bins[-1] + (bins[-1] - bins[-2] if len(bins) > 1 else 0)   # where the last bin ends
    factor = args.context / max(end, 1)
    schedules = [(f"{args.speedup} as calibrated: {list(schedule.budgets)} from {list(bins)}", schedule)]
    if len(bins) > 1 and factor > 1:   # a constant budget has no length to stretch; shrunk, bins would merge
        schedules.append((f"the same stretched x{factor:.0f} to {args.context} tokens", schedule.scaled(factor)))
    schedules += [(f"constant budget {b} (for scale)", constant(b)) for b in (8192, 4096, 2048)]
    print(speedup_table(schedules, args.context, args.batch, args.policy, **args.pages))


def main(argv=None):
    args, p = parse_args(argv)
    calibrated = print_calibration(args, p) if args.calibrate else None
    if args.speedup is not None:   # --speedup the file --calibrate just wrote: that schedule
        print_speedup(args, args.schedule or calibrated)


if __name__ == "__main__":
    main()
