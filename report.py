"""Comparison tables, printed as markdown (docs/method.md sections 2, 4, 5 and 7).

    python report.py inference --model smollm2-135m --data ../shared/data/gsm8k/test.jsonl --limit 100 \\
        --policies snapkv rkv h2o streaming --budgets 64 128 --interval 32 > results/smollm2_gsm8k.md

`inference`: what eviction costs one model at inference time. The first --limit questions of a JSONL file are
answered greedily with a full cache, then under each (policy, budget): accuracy, peak KV and the acceptance alpha =
sum_v min(p_dense, p_sparse) over the sampler's top-k tokens, its mean and its 5th percentile over all response
tokens (the tail that stayed >= 0.86 in stable training runs, section 4). Its dense side is one teacher-forced pass
over each response (`correction.dense_logprobs`), the pi_old of a training step. Progress goes to stderr.

    python report.py runs results/runs/{dense,naive,tis,sparse-rl,schedule}-s? --robust-budgets 12 10 \\
        --out results/corrections                                   # as reproduce.sh does

`runs`: what training did. Each RUN_DIR is a `python train.py --out RUN_DIR` folder named <variant>-s<seed>: one
row per variant, in the order given, its seeds averaged. PREFIX.md holds three tables (`report_text`) and, with
matplotlib, three plots (`plot`). --robust-budgets B ...: each run's final model answers its own held-out prompts
greedily through the run's cache at budget B (SnapKV for a dense run; theta alone, without a --distill run's
adapter): Sparse-RL's claim that a model trained on sparse rollouts holds up better under sparse inference.
gpu_smollm2.sh reads its SmolLM2 runs the same way.

keeps.py draws which positions of one toy rollout each policy keeps.
"""
import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

import cli
import distill
import train
from correction import ALPHA_TOPK
from evaluate import accuracy, eval_rewards, run_inference, run_reward
from kvcache import POLICIES, SparseConfig
from models import CACHE_DIR, DTYPES, SMOLLM2, autocast, last_checkpoint, load_pretrained, pick_device
from schedule import THRESHOLD
from tasks import load_jsonl, numeric_reward


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = p.add_subparsers(dest="command", required=True)
    g = commands.add_parser("inference", help="accuracy, KV memory and acceptance of each policy at inference",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g.add_argument("--model", default=SMOLLM2, help="HF folder, hub id, GGUF file, or " + SMOLLM2)
    g.add_argument("--gguf-file", default=None, help="GGUF file name inside the --model folder")
    g.add_argument("--cache-dir", default=CACHE_DIR, help="where a GGUF model is kept de-quantised")
    g.add_argument("--data", required=True, help="JSONL of {question, answer} or {prompt, answer}")
    g.add_argument("--limit", type=int, default=100, help="the first N examples of --data")
    g.add_argument("--max-new-tokens", type=int, default=256, help="the longest answer")
    g.add_argument("--policies", nargs="+", default=["snapkv", "rkv", "h2o", "streaming"],
                   choices=[p for p in POLICIES if p != "full"], help="a row per policy and budget")
    g.add_argument("--budgets", type=int, nargs="+", default=[64, 128], help="tokens kept per layer and KV head")
    g.add_argument("--interval", type=int, default=32, help="compress every N tokens once over budget")
    g.add_argument("--window", type=int, default=8, help="recent tokens always kept")
    g.add_argument("--sink", type=int, default=4, help="first tokens kept by streaming")
    g.add_argument("--batch-size", type=int, default=25, help="questions decoded together")
    g.add_argument("--adapter", metavar="FILE", help="a DistillSparse adapter.safetensors: the sparse rows sample "
                   "with theta + phi (the dense row and the dense side of alpha stay theta)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA if torch sees a GPU")
    g.add_argument("--dtype", default="float32", choices=list(DTYPES), help="precision of the weights")
    g = commands.add_parser("runs", help="compare train.py runs: accuracy, KV memory, rejection, time, tail, PODS")
    g.add_argument("folders", nargs="*", metavar="RUN_DIR", help="train.py --out folders named <variant>-s<seed>")
    g.add_argument("--out", required=True, metavar="PREFIX",
                   help="writes PREFIX.md and, with matplotlib, PREFIX_reward.png, PREFIX_accuracy.png, PREFIX_tail.png")
    g.add_argument("--robust-budgets", type=int, nargs="+", default=[], metavar="B",
                   help="also evaluate each final model greedily through the run's cache at budget B")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto (the default): CUDA if torch sees a GPU")
    return p.parse_args(argv)


def inference(args):
    """Check everything, load the model, run dense and each (policy, budget); -> the markdown table."""
    cli.check_least(args, 1, ["limit", "max_new_tokens", "interval", "batch_size", "budgets"])
    pairs = dict.fromkeys((budget, policy) for budget in args.budgets for policy in args.policies)  # each once
    configs = [SparseConfig("full")] + [SparseConfig(policy, budget, args.interval, args.window, args.sink)
                                        for budget, policy in pairs]                            # raise early
    examples = load_jsonl(args.data)[: args.limit]
    if args.adapter and not Path(args.adapter).is_file():
        raise ValueError(f"--adapter {args.adapter!r}: no such file")
    device = pick_device(args.device)
    model, tokenizer = load_pretrained(args.model, args.gguf_file, args.cache_dir, device, DTYPES[args.dtype])
    adapter = distill.LoRA.from_file(model, args.adapter) if args.adapter else None
    results = [run_inference(model, tokenizer, examples, numeric_reward, sparse, args.max_new_tokens, args.batch_size,
                             adapter) for sparse in tqdm(configs, desc="configurations", dynamic_ncols=True)]
    header = ["rollout", "budget", "accuracy", "peak KV (MiB)", "vs dense", "alpha mean", "alpha p05", "tokens",
              "time (s)"]
    dense, rows = results[0], []                                      # configs[0] is the full cache
    for sparse, r in zip(configs, results):
        rollout = ["dense", "-"] if sparse.policy == "full" else [sparse.policy, sparse.budget]
        rows.append(rollout + [f"{r['accuracy']:.2f}", f"{r['peak_kv_bytes'] / 2**20:.1f}",
                               f"{r['peak_kv_bytes'] / dense['peak_kv_bytes']:.0%}", f"{r['alpha_mean']:.3f}",
                               f"{r['alpha_p05']:.3f}", r["tokens"], f"{r['seconds']:.0f}"])
    return (f"{len(examples)} questions of {args.data}, greedy, {args.max_new_tokens} new tokens, interval "
            f"{args.interval}, window {args.window}, sink {args.sink}; peak KV summed over batches of "
            f"{args.batch_size} (the prompt is kept whole at prefill, so its length sets a floor); alpha over the "
            f"sampler's top-{ALPHA_TOPK} tokens, a lower bound whose ceiling (the top-{ALPHA_TOPK} mass) the dense "
            "row shows\n\n" + cli.markdown(header, rows))


# ----------------------------------------------------------------------------- runs: comparing training runs

# what the tables and plots read of each line, besides its step: checked as each run is read, before any model
# loads (else a folder of other JSON lines is a KeyError, after --robust-budgets' evaluations)
LOG_KEYS = {"metrics.jsonl": ("reward", "tokens", "dropped_tokens", "vetoed", "peak_kv_bytes", "dense_kv_bytes",
                              "rollout_s", "scoring_s", "update_s"), "eval.jsonl": ("dense", "sparse")}


def read_run(folder):
    """(metrics lines, eval lines) of a `train.py --out` folder, each sorted by step (a repeated step: its last line).
    An error names the first bad line by its number in the file (blank lines count: an editor's line number), or an
    eval.jsonl whose first evaluation is not step 0's."""
    logs = []
    for name, keys in LOG_KEYS.items():
        path = Path(folder) / name
        if not path.is_file():
            raise ValueError(f"{folder!r} is not a train.py run folder: it holds no {name}"
                             + (" (results/runs is made by `bash reproduce.sh`)" if "results/runs" in str(folder) else ""))
        try:
            content = path.read_text()
        except UnicodeDecodeError as error:                # a packed or binary file: name it, not the codec
            raise ValueError(f"{path} is not text (UTF-8): byte {error.object[error.start]:#04x} at "
                             f"position {error.start}") from None
        numbered = [(number, text) for number, text in enumerate(content.splitlines(), 1) if text.strip()]
        lines = []
        for number, text in numbered:
            try:
                line = json.loads(text)
            except json.JSONDecodeError as error:      # a last line half written by a killed run is dropped,
                if number < numbered[-1][0]:           # as train.py --resume drops it
                    raise ValueError(f"{path} line {number} is not JSON: {error.msg} (column {error.colno})") from None
                continue
            if not isinstance(line, dict) or type(line.get("step")) is not int:
                raise ValueError(f"{path} line {number} has no \"step\" (a whole number): not a train.py log")
            if lacking := [key for key in keys if key not in line]:
                raise ValueError(f"{path} line {number} has no {lacking[0]!r}: not a train.py log")
            if odd := [key for key in keys if type(line[key]) not in (int, float)]:   # bool, None, str: a traceback
                raise ValueError(f"{path} line {number}: {odd[0]!r} is {line[odd[0]]!r}, not a number: not a "
                                 "train.py log")
            lines.append(line)
        if not lines:                                  # blank, or one line a killed run left half written
            raise ValueError(f"{path} holds no whole line: its only line, {numbered[0][0]}, is half written "
                             "(not JSON)" if numbered else f"{path} is empty")
        logs.append(sorted({line["step"]: line for line in lines}.values(), key=lambda line: line["step"]))
    if (first := logs[1][0]["step"]) != 0:                 # 'before RL' and the gain read the first as step 0's
        raise ValueError(f"{Path(folder) / 'eval.jsonl'} starts at step {first}: it lacks the evaluation before RL, "
                         "at step 0 (train.py writes it first)")
    return tuple(logs)


def variant_of(folder):
    """'results/runs/sparse-rl-s2' -> 'sparse-rl': run folders are named <variant>-s<seed>."""
    return re.sub(r"-s\d+$", "", Path(os.path.abspath(folder)).name)


def mean_std(values):
    """Mean and sample standard deviation (ddof 1; 0 for a single seed)."""
    values = np.asarray(values, dtype=float)
    return values.mean(), values.std(ddof=1) if len(values) > 1 else 0.0


def seconds(line):
    """Training seconds of one step: sampling, re-scoring, update (a DistillSparse adapter's too); no evaluation."""
    return line["rollout_s"] + line["scoring_s"] + line["update_s"] + line.get("distill_s", 0)


def last_steps(runs):
    """The sorted distinct steps of the last evaluations of a variant's runs [(metrics, evals) per seed]."""
    return sorted({evals[-1]["step"] for _, evals in runs})


def comparison_rows(groups, robust=None):
    """One row per variant of {variant: [(metrics, evals) per seed]}: the cells under `report_text`'s header, whose
    line above the table says what each column holds; accuracies as mean ± sample std over seeds (a single seed's
    value alone: one seed measures no spread), the rest as means.
    `robust`: {variant: [[accuracy at each budget B] per seed]}. Where that line is brief:

    steps              the last evaluation's step (a run cut short by a time limit ends before its --steps):
                       "first-last" where the seeds end at different steps (`report_text` says which)
    vetoed, train time totals over the steps up to it, the training behind the 'after' columns (a killed run
                       logs steps past its last evaluation); the other columns are means over every logged step
    sparse before RL   what eviction costs the warm-started model
    of first's gain    "-" unless the first variant's gain exceeds its std over seeds (a ratio to noise is noise)
    """
    pm = lambda values: "{:.3f} ± {:.3f}".format(*mean_std(values)) if len(values) > 1 else f"{values[0]:.3f}"
    gain = lambda evals: [e[-1]["dense"] - e[0]["dense"] for e in evals]       # one per seed
    first, std = mean_std(gain([e for _, e in next(iter(groups.values()))]))
    first = first if first > std else 0
    rows = []
    for variant, runs in groups.items():
        metrics, evals = [m for m, _ in runs], [e for _, e in runs]
        behind = [[m for m in ms if m["step"] <= e[-1]["step"]] for ms, e in runs]   # the steps before 'after'
        ends = last_steps(runs)
        row = [variant, len(runs), f"{ends[0]}-{ends[-1]}" if len(ends) > 1 else str(ends[0]),
               pm([e[0]["dense"] for e in evals]), pm([e[0]["sparse"] for e in evals]),
               pm([e[-1]["dense"] for e in evals]), pm([e[-1]["sparse"] for e in evals]), pm(gain(evals)),
               f"{np.mean(gain(evals)) / first:.0%}" if first else "-"]
        row += [pm(accs) for accs in zip(*robust[variant])] if robust else []
        total = lambda key, ms: sum(m[key] for m in ms)                           # over one run's steps
        per_step = lambda f: np.mean([np.mean([f(m) for m in ms]) for ms in metrics])  # mean over steps, then seeds
        row += [f"{per_step(lambda m: m['peak_kv_bytes'] / m['dense_kv_bytes']):.1%}",
                f"{np.mean([total('dropped_tokens', ms) / max(total('tokens', ms), 1) for ms in metrics]):.1%}",
                f"{np.mean([total('vetoed', ms) for ms in behind]):.1f}",
                f"{np.mean([sum(map(seconds, ms)) for ms in behind]):.0f}"]
        row += [f"{per_step(f):.2f}" for f in (seconds, lambda m: m["rollout_s"], lambda m: m["scoring_s"],
                                                lambda m: m["update_s"] + m.get("distill_s", 0))]  # the adapter too
        rows.append(row)
    return rows


def tail_by_variant(groups):
    """{variant: {(first, last) context of a length bin: tail}}: the per-step 5th percentile of the acceptance
    alpha in each bin (docs/method.md section 4), averaged over all steps and seeds that had tokens in the bin."""
    tails = {}
    for variant, runs in groups.items():
        pooled = {}
        for metrics, _ in runs:
            for m in metrics:
                for i, tail in enumerate(m.get("alpha_p05_by_bin") or []):
                    if tail is not None:
                        pooled.setdefault((i * m["bin_size"], (i + 1) * m["bin_size"] - 1), []).append(tail)
        tails[variant] = {b: float(np.mean(pooled[b])) for b in sorted(pooled)}
    return tails


def mean_curve(logs, key):
    """[(step, mean over seeds of line[key])] at the steps every seed logged; `logs`: one list of lines per seed."""
    by_step = [{line["step"]: line[key] for line in lines} for lines in logs]
    steps = sorted(set.intersection(*(set(d) for d in by_step)))
    return [(s, float(np.mean([d[s] for d in by_step]))) for s in steps]


def reach_rows(groups):
    """When each variant first reaches the baseline's (the first variant's) best dense accuracy, PODS's measure
    (docs/method.md section 7); accuracies are means over seeds, and only evaluations after step 0 count.
    -> (best, accuracy at step 0, [(variant, first step, training seconds to it (mean over seeds), the baseline's
    seconds / these)], None where never), or None when the baseline never evaluated after step 0."""
    curves = {variant: mean_curve([e for _, e in runs], "dense") for variant, runs in groups.items()}
    baseline = next(iter(curves.values()))
    best = max((a for s, a in baseline if s > 0), default=None)
    if best is None:
        return None
    reached = {}
    for variant, runs in groups.items():
        step = next((s for s, a in curves[variant] if s > 0 and a >= best - 1e-9), None)
        reached[variant] = (step, None if step is None else
                            float(np.mean([sum(seconds(m) for m in ms if m["step"] <= step) for ms, _ in runs])))
    base_time = reached[next(iter(groups))][1]
    return best, baseline[0][1], [(v, step, t, base_time / t if t else None) for v, (step, t) in reached.items()]


def report_text(groups, budgets=(), robust=None):
    """The comparison, the tail per length bin and the PODS table, each with its meaning in one line above it."""
    base = next(iter(groups))                                         # the first variant, the baseline
    header = ["variant", "seeds", "steps", "dense before RL", "sparse before RL", "dense", "sparse", "dense gain",
              f"of {base}'s gain", *[f"sparse @ {b}" for b in budgets], "peak KV vs dense", "dropped tokens",
              "vetoed", "train time (s)", "s/step", "sampling", "re-scoring", "update"]
    text = ["Greedy accuracy on each run's held-out prompts, mean ± sample std over seeds (divided by n - 1; a "
            "single seed's value alone): with a full cache (dense) and through the run's training cache (sparse; "
            "full for a dense run), before and after RL; the dense gain (after - before) and its share of the first "
            "variant's"
            + (", or its cache at budget B (sparse @ B)" if budgets else "") + "; mean over seeds of: the rollouts' "
            "peak KV against a full cache, the share of response tokens the rejection dropped, the responses it "
            "vetoed, and the seconds spent sampling, re-scoring and updating (in all up to the last evaluation, then "
            "per step and by part).", "",
            cli.markdown(header, comparison_rows(groups, robust))]
    for variant, runs in groups.items():   # an unfinished seed moves its variant's means: said, not hidden
        if len(ends := last_steps(runs)) > 1:
            text += ["", f"Note: the seeds of {variant} end at different steps ({', '.join(map(str, ends))}; a run cut "
                     "short ends early), so its 'after' columns, vetoed and train time average runs of different "
                     "lengths, and its accuracy curve and time to the baseline's best stop at step "
                     f"{ends[0]}, where the shortest ends."]                     # mean_curve: steps every seed has
        # a metrics.jsonl with steps lost (not a killed run's: it logs every step up to its last evaluation)
        logged = [len([m for m in ms if 0 < m["step"] <= e[-1]["step"]]) for ms, e in runs]
        if lacking := [e[-1]["step"] - n for (_, e), n in zip(runs, logged) if n < e[-1]["step"]]:
            text += ["", f"Note: {len(lacking)} of the {len(runs)} seeds of {variant} lack the metrics of "
                     f"{sum(lacking)} steps in all before their last evaluation, so its vetoed, train time and time "
                     "to the baseline's best count only the steps logged."]
    tails = tail_by_variant(groups)
    bins = sorted({b for t in tails.values() for b in t})
    text += ["", "Acceptance tail by context length: the 5th percentile of alpha = 1 - TV(p_dense, p_sparse) "
             f"over each bin's response tokens, mean over steps and seeds (Sparrow: stable while >= {THRESHOLD}).", "",
             cli.markdown(["variant"] + [f"{a}-{b}" for a, b in bins],
                      [[v] + [f"{t[b]:.3f}" if b in t else "-" for b in bins] for v, t in tails.items()])]
    if reach := reach_rows(groups):
        best, start, rows = reach
        text += ["", "Time to the baseline's best (PODS's measure): the first evaluation after step 0 at which a "
                 f"variant's dense accuracy (mean over seeds) reaches {base}'s best, {best:.3f} (step 0: {start:.3f}), "
                 "with the training seconds it took (mean over seeds).", "",
                 cli.markdown(["variant", "first step", "train time (s)", f"speed-up vs {base}"],
                          [[v, "never", "-", "-"] if step is None else [v, step, f"{t:.0f}", f"{x:.2f}x" if x else "-"]
                           for v, step, t, x in rows])]
    return "\n".join(text)


def pyplot(paths):
    """matplotlib.pyplot drawing to files, or None after a one-line warning naming the `paths` not written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"warning: matplotlib is not installed, so {', '.join(map(str, paths))} not written "
              "(pip install matplotlib)", file=sys.stderr)
        return None
    return plt


def running_mean(ys, k=10):
    """Mean of the last k values at each point (fewer at the start)."""
    sums, i = np.cumsum(np.insert(np.asarray(ys, dtype=float), 0, 0.0)), np.arange(1, len(ys) + 1)
    return (sums[i] - sums[np.maximum(i - k, 0)]) / np.minimum(i, k)


def plot(groups, prefix):
    """PREFIX_reward.png, PREFIX_accuracy.png, PREFIX_tail.png, one line per variant; without matplotlib, a warning."""
    if (plt := pyplot([f"{prefix}_{name}.png" for name in ("reward", "accuracy", "tail")])) is None:
        return
    figures = [("reward", "step", "training reward (running mean of 10)",
                {v: mean_curve([m for m, _ in runs], "reward") for v, runs in groups.items()}),
               ("accuracy", "step", "greedy accuracy, full cache",
                {v: mean_curve([e for _, e in runs], "dense") for v, runs in groups.items()}),
               ("tail", "context length (bin start)", "alpha p05 (mean over steps)",
                {v: [(b[0], t) for b, t in tails.items()] for v, tails in tail_by_variant(groups).items()})]
    for name, xlabel, ylabel, curves in figures:
        fig, ax = plt.subplots(figsize=(6.4, 4))
        for variant, points in curves.items():
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, running_mean(ys) if name == "reward" else ys, label=variant,
                        marker=None if name == "reward" else "o")
        if name == "tail":
            ax.axhline(THRESHOLD, color="grey", linestyle="--", linewidth=1, label=f"Sparrow's {THRESHOLD}")
        ax.set(xlabel=xlabel, ylabel=ylabel)
        ax.legend()
        fig.tight_layout()
        fig.savefig(f"{prefix}_{name}.png", dpi=120)
        plt.close(fig)


def robust_plan(folder, final_step, budgets):
    """(final checkpoint, its train.py args, [cache per budget]) of one run; ValueError before any model is loaded.
    The cache is the run's own (policy, interval, window, sink) at budget B; SnapKV for a run trained dense."""
    ckpt = last_checkpoint(Path(folder))
    if ckpt is None or not (ckpt / "args.json").is_file():
        raise ValueError(f"{folder!r} holds no checkpoint step-NNNNNN with args.json (--robust-budgets needs it)")
    if int(ckpt.name.split("-")[1]) != final_step:
        raise ValueError(f"the last checkpoint of {folder!r}, {ckpt.name}, is not its final step {final_step}")
    args = cli.parse_args([])                                   # defaults for keys an older args.json lacks
    path = ckpt / "args.json"                                   # a damaged one: one line naming it
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read {path} ({error}): --robust-budgets needs the run's settings") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{path} holds a {type(saved).__name__}, not a run's settings (a JSON object)")
    vars(args).update(saved)
    policy = "snapkv" if args.policy == "full" else args.policy
    for path in (args.data, args.eval_data):                     # the held-out prompts are rebuilt from them
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{folder!r} was trained on {path!r}, which is not there (its args.json)")
    try:
        return ckpt, args, [train.sparse_config(args, policy, b) for b in budgets]   # as train.py's evaluations
    except ValueError as error:
        raise ValueError(f"--robust-budgets for {folder!r}: {error}") from None


def robust_accuracy(ckpt, args, configs, device):
    """Greedy accuracy of a final model on its run's own held-out prompts (rebuilt as train.py does), per cache.
    As train.py evaluates: fp32 weights, --dtype bfloat16 under autocast (bf16 weights answer otherwise). The model
    is theta alone, a DistillSparse run's too: its adapter is its sparse column's sampler, and README's distill
    table reads *sparse @ B* as the same policy without it."""
    model, tokenizer = load_pretrained(str(ckpt), device=device)
    _, held_out = train.load_data(args)
    with autocast(args.dtype, model.device):
        return [accuracy(eval_rewards(model, tokenizer, held_out, run_reward(args), sparse, args.max_new_tokens))
                for sparse in configs]


def runs(args):
    """Check everything, read the runs, evaluate the final models at --robust-budgets; -> the report (markdown)."""
    if not args.folders:
        raise ValueError("no run folders given")
    names = [Path(os.path.abspath(f)).name for f in args.folders]
    if twice := [f for f, name in zip(args.folders, names) if names.count(name) > 1]:   # it would count as two seeds
        raise ValueError(f"the run folders {' and '.join(map(repr, twice))} share a name: each is one seed of a "
                         "variant, named <variant>-s<seed>")
    cli.check_least(args, 1, ["robust_budgets"])
    args.robust_budgets = list(dict.fromkeys(args.robust_budgets))   # 12 12: one evaluation, one column
    device = pick_device(args.device)
    logs = [read_run(folder) for folder in args.folders]
    plans = [robust_plan(folder, evals[-1]["step"], args.robust_budgets)
             for folder, (_, evals) in zip(args.folders, logs)] if args.robust_budgets else []
    groups, robust = {}, {}
    for folder, log in zip(args.folders, logs):
        groups.setdefault(variant_of(folder), []).append(log)
    for folder, plan in zip(args.folders, tqdm(plans, desc="final models", dynamic_ncols=True, disable=not plans)):
        robust.setdefault(variant_of(folder), []).append(robust_accuracy(*plan, device))
    plot(groups, args.out)
    return report_text(groups, args.robust_budgets, robust)


def main(argv=None):
    args = parse_args(argv)
    start = time.time()
    try:
        cli.check_values(args, unchecked=("limit", "budgets", "robust_budgets"))   # any size: all
        if args.command == "runs":                                     # PREFIX.md beside a folder PREFIX is fine
            cli.check_out_file(args.out, "a file name prefix", prefix=True)
        table = dict(inference=inference, runs=runs)[args.command](args)
    except (ValueError, OSError) as error:
        sys.exit(f"error: {error}")
    text = (f"`python report.py {' '.join(sys.argv[1:] if argv is None else argv)}`, "
            f"wall time {(time.time() - start) / 60:.1f} min\n\n{table}")
    print(text)
    if args.command == "runs":
        Path(f"{args.out}.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
