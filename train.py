"""Sparse-RL: GRPO on rollouts sampled through a compressed KV cache (docs/method.md sections 1, 5, 7, 8).

    python train.py                              # tiny Llama on the toy task, CPU, a few minutes
    python train.py --correction none            # naive sparse training, no correction
    python train.py --policy full                # dense GRPO, the baseline
    python train.py --distill ppo-kl             # DistillSparse: a LoRA adapter for the sparse sampler
    python train.py --steps 0 --eval-policies snapkv streaming --eval-budgets 16 24   # evaluate only
    python train.py --resume                     # continue from the last checkpoint in --out
    python train.py --model PATH --data train.jsonl --eval-data test.jsonl --device cuda --dtype bfloat16
    python train.py --model smollm2-135m         # a real model on the CPU: 5 steps on arithmetic questions
    python train.py --model smollm2-135m --device cuda   # ... on one GPU: 16 x 8 rollouts, bf16 autocast

The settings of each kind of run, the flags and their checks are in cli.py (`--help` shows every value).

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
import copy
import json
import random
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
from cli import check_args, check_fits, parse_args, resume_point
from controller import HIGH, Controller
from evaluate import eval_both, evaluate_only, rewards_of, run_reward
from kvcache import SparseConfig
from models import (autocast, last_checkpoint, load_checkpoint, load_pretrained, pick_device,
                    save_atomically, save_checkpoint, set_aside, toy_model, warm_up, write_text_atomically)
from sampler import check_length, clock, generate
from tasks import (ALPHABET, char_tokenizer, encode_prompt, held_out_examples, load_jsonl, longest_prompt_chars,
                   make_examples)


# ----------------------------------------------------------------------------- the rollout cache

def sparse_config(args, policy=None, budget=None, longest_prompt=0):
    """The rollout cache: a fixed --budget, a calibrated --schedule, or an online --controller whose bins
    cover `longest_prompt` + --max-new-tokens (`policy` and `budget` given: that fixed cache, for an evaluation)."""
    # a --schedule's budgets replace --budget, and each is checked instead
    schedule = S.Schedule.load(args.schedule) if policy is None and args.schedule else None
    try:
        sparse = SparseConfig(policy or args.policy, args.budget if budget is None else budget, args.interval,
                              args.window, args.sink, page_size=args.page_size, dense_layers=args.dense_layers,
                              schedule=schedule)
    except ValueError as error:   # an evaluation's cache: name the flags that made it
        raise ValueError(f"the evaluation cache {policy} at budget {budget}: {error}" if policy else error) from None
    if policy is not None or args.controller is None:
        return sparse
    # --controller: its lowest budget and its pages come from the checked cache, so it goes in after
    bins = S.bins_for(longest_prompt, args.max_new_tokens, args.bin_size)
    return replace(sparse, schedule=Controller(args.controller, args.bin_size, bins, start=args.budget,
                                               low=sparse.min_budget, high=max(HIGH, args.budget),
                                               step=max(1, args.budget // 8),
                                               interval=args.interval, page_size=sparse.pages))


# ----------------------------------------------------------------------------- model and data

def load_model(args, device):
    """(model with fp32 weights, tokenizer): from --model, or the toy model, warmed up once and cached in
    <out>/warmup. --dtype bfloat16 runs the forward passes under autocast (models.autocast), not the weights.

    The warm-up is saved with the settings it was made with (warmup.json); a cached one made with other
    settings is made anew, never silently reused. RL settings do not count: runs that differ only in
    them share a warm-up.
    """
    if args.model is not None:
        return load_pretrained(args.model, args.gguf_file, args.cache_dir, device, torch.float32)
    cached = Path(args.out) / "warmup"
    settings = dict(task=args.task, digits=list(args.digits), warmup_steps=args.warmup_steps, seed=args.seed,
                    alphabet=ALPHABET)
    try:                                                               # unreadable: as unrecorded, made anew
        made = json.loads((cached / "warmup.json").read_text())
    except (OSError, ValueError):
        made = None
    if made != settings:
        if cached.is_dir():
            print(f"{cached} was made with {made or 'unrecorded settings'}; making a new warm-up for {settings}")
        tokenizer = char_tokenizer()
        torch.manual_seed(args.seed)
        model = toy_model(tokenizer).to(device)
        # checked here too, not only after loading as every model is: before the warm-up's long computation
        longest = longest_prompt(args, None, None, tokenizer)
        check_length(longest, args.max_new_tokens, model.config)
        check_fits(args, model, longest)
        warm_up(model, tokenizer, args.task, args.warmup_steps, args.digits)
        save_atomically(cached, lambda tmp: (model.save_pretrained(tmp), tokenizer.save_pretrained(tmp),
                                             (tmp / "warmup.json").write_text(json.dumps(settings))))
    return load_pretrained(str(cached), device=device)


def load_data(args):
    """(train examples or None for the toy task, eval examples): lists of {"prompt", "answer"}."""
    if args.data is None:
        return None, held_out_examples(args.task, args.eval_size, args.seed, *args.digits)
    train = load_jsonl(args.data)
    held_out = load_jsonl(args.eval_data) if args.eval_data else train[-args.eval_size:]
    train = train if args.eval_data else train[: -args.eval_size]
    if args.steps and len(train) < args.prompts:                      # an evaluation (--steps 0) takes no step
        if args.eval_data:
            raise ValueError(f"{args.data} holds {len(train)} training examples; a step needs --prompts {args.prompts}")
        raise ValueError(f"{args.data} leaves {len(train)} training examples after the {args.eval_size} held out "
                         f"(--eval-size); a step needs --prompts {args.prompts}: pass --eval-data or a smaller --eval-size")
    if len(held_out) < args.eval_size:                                 # evaluated whole: said, not silently cut
        print(f"held out: all {len(held_out)} examples of {args.eval_data or args.data}, < --eval-size {args.eval_size}")
    return train, held_out[: args.eval_size]


def longest_prompt(args, train, held_out, tokenizer):
    """Tokens of the longest prompt the run can meet: its data's, or the toy task's longest possible."""
    if train is None:
        return len(encode_prompt(tokenizer, "")) + longest_prompt_chars(args.task, args.digits[1])
    return max(len(encode_prompt(tokenizer, e["prompt"])) for e in train + held_out)


def step_seed(args, step):
    """The one number all of a step's randomness comes from (its prompts, sampling, down-sampling, shuffles):
    a function of (seed, step) alone, so a resumed run repeats it. 100_003 is over any step count, so no two
    (seed, step) pairs meet."""
    return args.seed * 100_003 + step


def step_examples(args, train, step):
    """The prompts of one step; a function of (seed, step) only, so a resumed run sees the same ones."""
    if train is None:
        return make_examples(args.task, args.prompts, step_seed(args, step), *args.digits)
    return random.Random(step_seed(args, step)).sample(train, args.prompts)


# ----------------------------------------------------------------------------- one step

def rl_step(model, ref_model, opt, tokenizer, examples, reward, sparse, args, step, lora=None, lora_opt=None):
    """Sample, score, correct and learn from one batch of prompts (`examples`: P dicts {"prompt", "answer"}, each
    sampled --group-size times); returns the step's metrics, one line of metrics.jsonl.
    With a DistillSparse `lora` adapter, the sampler is theta + phi, and phi learns after theta."""
    t0 = clock(model.device)                                           # each phase's seconds, once the GPU is done
    seed = step_seed(args, step)
    group = [e for e in examples for _ in range(args.group_size)]      # n rollouts per prompt, consecutive
    with lora.on() if lora else nullcontext(), autocast(args.dtype, model.device):   # record: for phi's forward
        rollouts = generate(model, [encode_prompt(tokenizer, e["prompt"]) for e in group], sparse,
                            args.max_new_tokens, args.temperature, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id, seed=seed, record=lora is not None,
                            captured=args.captured)
    rewards = rewards_of(rollouts, group, tokenizer, reward)
    metrics = dict(step=step, reward=rewards.mean().item(), accuracy=(rewards == 1).float().mean().item())
    # PODS: train on the m most informative, re-scored alone (PODS's saving): every measurement below (rho,
    # alpha, its tail per bin, the controller's probe) describes the kept rollouts, not all n sampled
    if args.keep < args.group_size:
        keep = C.downsample(rewards, args.group_size, args.keep, args.downsample, torch.Generator().manual_seed(seed))
        rollouts, rewards = rollouts.select(keep), rewards[keep]
    t1 = clock(model.device)
    # pi_old: the same weights, full prefix (docs/method.md section 1). Even naive training re-scores:
    # the PPO ratio needs pi_old, and the mismatch is measured for every variant.
    with autocast(args.dtype, model.device):
        logp_old, topk_old = C.dense_logprobs(model, rollouts, args.micro_batch, args.temperature, topk=True)
    log_rho = logp_old - rollouts.logprobs                          # rho = pi_old / pi_sparse
    metrics.update(C.mismatch_stats(logp_old, rollouts.logprobs, rollouts.mask, topk_old, rollouts.topk_logprobs,
                                    *args.band))
    # Sparrow's tail per length bin (section 4); the controller's probe is this same measurement
    alpha, contexts = C.acceptance(topk_old, rollouts.topk_logprobs), S.token_contexts(rollouts)
    budget = None if sparse.policy == "full" else sparse.schedule or S.constant(sparse.budget)
    metrics.update(S.bin_metrics(alpha, contexts, args.bin_size, budget))
    if isinstance(sparse.schedule, Controller):                        # the next step samples with new budgets
        sparse.schedule.update(alpha.cpu(), contexts.cpu())
    mask, weights = rollouts.mask, torch.ones_like(rollouts.mask)
    if args.correction == "sparse-rl":                               # section 5: reject, then reweight
        mask, reject = C.rejection_mask(log_rho, rollouts.mask, args.veto, *args.band)
        metrics.update(reject)
    if args.correction in ("sparse-rl", "tis"):                      # normalised over the ORIGINAL mask
        weights = C.importance_weights(log_rho, rollouts.mask, args.cap)
    advantages, adv = C.group_advantages(rewards, args.keep, scale=not args.no_std)   # from all rewards
    metrics.update(adv)
    with autocast(args.dtype, model.device):
        logp_ref = C.dense_logprobs(ref_model, rollouts, args.micro_batch, args.temperature) if ref_model else None
    t2 = clock(model.device)
    advantages = advantages.to(logp_old.device)
    loss, clip_frac = update(model, opt, rollouts, logp_old, advantages, mask, weights, logp_ref, args, seed)
    t3 = clock(model.device)                                           # AdamW's step included
    if lora is not None:                                             # then phi, on the same rollouts
        metrics.update(distill.step(model, lora, lora_opt, rollouts, logp_old, advantages, args),
                       distill_s=clock(model.device) - t3)
    metrics.update(loss=loss, clip_frac=clip_frac, lr=opt.param_groups[0]["lr"],
                   mean_weight=(weights * mask).sum().item() / max(mask.sum().item(), 1),
                   peak_kv_bytes=rollouts.stats["peak_kv_bytes"], dense_kv_bytes=rollouts.stats["dense_kv_bytes"],
                   rollout_s=t1 - t0, scoring_s=t2 - t1, update_s=t3 - t2)
    return {"vetoed": 0, "dropped_tokens": 0, **metrics}           # without rejection: none


def update(model, opt, rollouts, logp_old, advantages, mask, weights, logp_ref, args, seed):
    """The learner: `--ppo-epochs` passes over the rollouts in shuffled minibatches of `--minibatch` (default all
    of them: one AdamW step per batch), each minibatch forward and backward `--micro-batch` rows at a time
    with the gradients accumulated. logp_old, mask, weights [N, T]; advantages [N]; logp_ref [N, T] or None.
    -> (mean loss, mean clip fraction) over the AdamW steps; a step's clip fraction is over its kept tokens, as
    policy_loss's, whatever the micro-batches."""
    order = torch.Generator().manual_seed(seed)                        # a new shuffle every epoch and step
    losses, clips = [], []
    model.train()
    for _ in range(args.ppo_epochs):                                 # epochs > 1 or several minibatches: r_t leaves 1
        for batch in torch.randperm(len(rollouts), generator=order).split(args.minibatch or len(rollouts)):
            batch = batch.to(logp_old.device)
            # the loss is a mean over the minibatch's responses (seq-mean) or tokens (token-mean) as sampled,
            # rejected ones included (correction.policy_loss): each micro-batch's part is its share of them
            size = lambda rows: len(rows) if args.agg == "seq-mean" else int((rollouts.mask[rows] > 0).sum())
            total = size(batch) or 1
            step_loss, clipped, kept = 0.0, 0.0, 0   # clip_frac: clipped / kept tokens of the minibatch
            for rows in batch.split(args.micro_batch):
                with autocast(args.dtype, model.device):                 # the forward; backward outside
                    logp = C.response_logprobs(model, rollouts.select(rows), args.temperature)
                loss, stats = C.policy_loss(logp, logp_old[rows], advantages[rows], mask[rows], weights[rows],
                                            args.clip, kl_coef=args.kl,
                                            logp_ref=None if logp_ref is None else logp_ref[rows], agg=args.agg,
                                            response_mask=rollouts.mask[rows])
                share = size(rows) / total
                (loss * share).backward()                            # this micro-batch's part of the mean
                step_loss += loss.item() * share
                clipped += stats["clip_frac"] * stats["tokens"]     # policy_loss's fraction is over kept tokens
                kept += stats["tokens"]
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()          # also with no signal (gradient 0): AdamW's momentum still moves the weights
            opt.zero_grad(set_to_none=True)
            losses.append(step_loss)
            clips.append(clipped / max(kept, 1))
    model.eval()
    return float(np.mean(losses)), float(np.mean(clips))


# ----------------------------------------------------------------------------- the run

def threads(args):
    """CPU threads for torch: --threads, else one for the toy model, since a second thread helps it alone (the
    quick start: 51 s on one, 36 s on two, on 2 idle cores) but costs far more beside another run (two runs side
    by side: 60 s each on one thread, 274 s each on two); torch's own for a real model."""
    return args.threads or (1 if args.model is None else torch.get_num_threads())


def truncate_log(path, last_step):
    """Keep the lines of a JSONL log up to `last_step` (a resumed run rewrites what came after); -> their steps.
    A line that is not JSON, such as one half written when the run was killed, is dropped."""
    lines, steps = [], []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                if (step := json.loads(line)["step"]) <= last_step:
                    lines.append(line)
                    steps.append(step)
            except (json.JSONDecodeError, KeyError, TypeError):
                pass
        write_text_atomically(path, "".join(l + "\n" for l in lines))   # a kill mid-write keeps the old log
    return steps


def main(argv=None):
    """Run training as the command line says; returns the trained model and the final evaluation."""
    args = parse_args(argv)
    out = Path(args.out)
    torch.manual_seed(args.seed)
    start_time, made = time.time(), []                               # made: the folders of --out this run makes
    try:
        check_args(args)
        device = pick_device(args.device)
        sparse = sparse_config(args)
        evals = [sparse_config(args, p, b) for p in args.eval_policies or [args.policy] if p != "full"
                 for b in args.eval_budgets or [args.budget]] if args.steps == 0 else []
        train, held_out = load_data(args)
        ckpt = resume_point(args, out) if args.resume else None
        holder = next(p for p in (out, *out.parents) if p.exists())   # --out itself, or what it would go in
        if not holder.is_dir():
            raise ValueError(f"--out {str(out)!r}: {str(holder)!r} is a file, not a folder")
        made = [p for p in (out, *out.parents) if not p.exists()]     # innermost first
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as error:                                       # /proc/x, a read-only disk
            raise ValueError(f"--out {str(out)!r}: cannot make that folder ({error.strerror})") from None
        torch.set_num_threads(threads(args))
        model, tokenizer = load_model(args, device)
        longest = longest_prompt(args, train, held_out, tokenizer)
        check_length(longest, args.max_new_tokens, model.config)
        check_fits(args, model, longest)
        loaded = load_checkpoint(ckpt, device, torch.float32) if ckpt else None   # model stays the base (ref_model)
    except (ValueError, OSError) as error:
        for folder in made:                                            # a failed load leaves no empty --out behind
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        sys.exit(f"error: {error}")
    if args.controller is not None:                                  # its bins: prompt + response, in tokens
        sparse = sparse_config(args, longest_prompt=longest)
    reward = run_reward(args)
    controller = sparse.schedule if isinstance(sparse.schedule, Controller) else None
    ref_model = copy.deepcopy(model).requires_grad_(False) if args.kl > 0 and args.steps else None   # not to evaluate
    start, state = 0, {}
    if ckpt:
        model, state = loaded
        start = state["step"]
        print(f"resuming from {ckpt} (step {start})")
    elif args.steps > 0 and (last_checkpoint(out) or (out / "eval.jsonl").exists()):   # its step-0 line: a run
        after = " (--resume would have continued it)" if last_checkpoint(out) else " (stopped before a checkpoint)"
        print(f"starting fresh in {out}: the run there moves to {set_aside(out)}{after}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    lora = distill.LoRA(model, args.lora_rank, seed=args.seed) if args.distill != "off" else None
    lora_opt = torch.optim.AdamW(lora.parameters(), lr=args.lr * args.lora_lr_scale, weight_decay=0.0) if lora else None
    if state:
        restore(state, ckpt, args, opt, lora, lora_opt, controller)
    if args.steps == 0:                                                # evaluate only
        with autocast(args.dtype, device):
            results = evaluate_only(model, tokenizer, held_out, reward, evals, args.max_new_tokens, lora)
        print(f"wall time: {time.time() - start_time:.1f} s")
        return model, results
    # a fresh start keeps no line; a resumed one its steps' lines, and the evaluation at its step only where an
    # uninterrupted run has one there (a multiple of --eval-every before the end): not the old run's final one
    evaluated = start > 0 and start % args.eval_every == 0 and start < args.steps
    truncate_log(out / "metrics.jsonl", start if start else -1)
    kept = truncate_log(out / "eval.jsonl", start if evaluated else start - 1)
    print(f"rollouts: {sparse}; correction: {args.correction}; {args.prompts} prompts x {args.group_size} "
          f"rollouts (train on {args.keep}); {args.steps} steps on {device}")

    def run_eval(step):
        with autocast(args.dtype, device):
            result = dict(step=step, **eval_both(model, tokenizer, held_out, reward, sparse, args.max_new_tokens, lora))
        with open(out / "eval.jsonl", "a") as f:
            f.write(json.dumps(result) + "\n")
        return result

    first_eval = run_eval(start) if start == 0 else None
    if evaluated and start not in kept:   # killed after its checkpoint at `start`, before its evaluation was written
        run_eval(start)
    # counted by hand, so that a step's numbers show beside its own count (an iterated bar still shows the step
    # before while this one evaluates and saves); a resumed run's count goes on from its checkpoint's step
    bar, history = tqdm(initial=start, total=args.steps, desc="GRPO", dynamic_ncols=True), []
    for step in range(start + 1, args.steps + 1):
        metrics = rl_step(model, ref_model, opt, tokenizer, step_examples(args, train, step), reward, sparse,
                          args, step, lora, lora_opt)
        history.append(metrics)
        with open(out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        bar.set_postfix(reward=f"{metrics['reward']:.2f}", acc=f"{metrics['accuracy']:.2f}",
                        dropped=f"{metrics['dropped_tokens'] / max(metrics['tokens'], 1):.2f}", refresh=False)
        bar.update()
        if step % args.eval_every == 0 and step != args.steps:
            tqdm.write(f"step {step}: eval {run_eval(step)}")
        if step % args.save_every == 0 or step == args.steps:
            # tensors, numbers and lists only; a step's randomness comes from (seed, step), and the global
            # torch RNG matters only to a --model with dropout
            state = dict(optimizer=opt.state_dict(), torch_rng=torch.get_rng_state(),
                         budgets=list(sparse.schedule.budgets) if sparse.schedule else None,
                         lora_optimizer=lora_opt.state_dict() if lora else None)
            save_checkpoint(out, step, model, tokenizer, args, state, lora)
    bar.close()
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
    if saved_lr != args.lr and args.steps:
        print(f"learning rate {args.lr} (the checkpoint was trained at {saved_lr})")
    torch.set_rng_state(state["torch_rng"])
    if lora is not None:
        if not (ckpt / "adapter.safetensors").is_file() or state.get("lora_optimizer") is None:
            sys.exit(f"error: {ckpt} holds no DistillSparse adapter; resume it without --distill")
        try:
            lora.load(ckpt / "adapter.safetensors")
        except ValueError as error:                                    # another rank, or a damaged file
            sys.exit(f"error: {error}")
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
    print(f"\n| accuracy (greedy, {len(history)} steps run) | dense inference | sparse ({sparse.name}) |"
          f"\n|---|---|---|\n| before RL | {first['dense']:.3f} | {first['sparse']:.3f} |\n"
          f"| after RL  | {last['dense']:.3f} | {last['sparse']:.3f} |")
    if history:
        peak, full, k = mean("peak_kv_bytes"), mean("dense_kv_bytes"), min(20, len(history))
        print(f"\npeak KV of the sparse rollouts: {peak / 1024:.0f} KiB per step, {peak / full:.1%} of a full cache "
              f"({full / 1024:.0f} KiB)")
        if "kept_tokens" in history[-1]:                              # rejection_mask's: --correction sparse-rl
            print(f"the correction's rejection: {sum(m['vetoed'] for m in history)} responses vetoed, "
                  f"{mean('dropped_tokens') / max(mean('tokens'), 1):.1%} of response tokens dropped")
        else:                                                          # not "0 vetoed, 0.0% dropped": none tested
            print("the correction's rejection: none (only --correction sparse-rl rejects)")
        first_k = (f"the first {k} steps" if history[0]["step"] == 1 else          # a resumed run's first steps
                   f"steps {history[0]['step']}-{history[k - 1]['step']}")
        print(f"training reward of the sparse rollouts: {mean('reward', history[:k]):.3f} over {first_k}, "
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
    try:
        main()
    except KeyboardInterrupt:   # a Ctrl-C is no crash: say what is kept instead of a traceback
        try:                    # a checkpoint this command can continue (not another run's, left in --out)
            args = parse_args()
            done = resume_point(args, Path(args.out))
        except (ValueError, OSError):
            done = None
        sys.exit("\ninterrupted: " + (f"{done} is the last checkpoint; the same command with --resume continues "
                                      "from it" if done else "no checkpoint written yet"))
