"""Evaluation: a policy's accuracy and reward on held-out prompts, dense and under a sparse sampler
(docs/method.md sections 2 and 4).

    from evaluate import accuracy, eval_rewards
    rewards = eval_rewards(model, tokenizer, held_out, reward, SparseConfig("snapkv", 12, 4, 4, 2), 12)   # [N]
    accuracy(rewards)                                              # the share of exact answers (reward 1)
    run_inference(model, tokenizer, examples, numeric_reward, sparse, 256, 25)   # + peak KV and alpha

Every answer is greedy (temperature 0), so an evaluation is a function of the weights and the cache
alone. With a DistillSparse adapter (`lora`), a sparse cache samples with theta + phi, the sparse
sampler as it is deployed; a full cache always samples with theta. train.py evaluates dense and
through its rollout cache at the start, every --eval-every steps and at the end (`eval_both`, one
line of <out>/eval.jsonl each), or evaluates only (`evaluate_only`, --steps 0); report.py's
`inference` table is `run_inference` per cache, its `runs --robust-budgets` columns `accuracy`.

    python evaluate.py --eval-policies snapkv streaming --eval-budgets 8 12   # = python train.py --steps 0 ...
"""
import sys
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from tqdm import tqdm

import correction as C
from cli import TRAINING_ONLY
from kvcache import SparseConfig
from sampler import clock, generate
from tasks import encode_prompt, exact_match, numeric_reward, reward_fn

BATCH = 128   # held-out prompts decoded together by eval_rewards
HELP = ("Greedy accuracy on held-out prompts, dense and through each cache: train.py --steps 0. It takes train.py's "
        "flags; those listed here count (the model, --seed's held-out prompts, the cache, --eval-*, the device); "
        "training's own (correction, GRPO, DistillSparse's losses) are accepted and do nothing; --steps is refused.")


def run_reward(args):
    """The reward of a train.py run with these `args`: `reward(completion, answer) -> float`."""
    return numeric_reward if args.data else exact_match if args.reward == "exact" else reward_fn(args.task)


def rewards_of(rollouts, examples, tokenizer, reward):
    """Reward of each rollout [N] (float, on the CPU) against the answer of its example: the text of its
    response tokens only (what follows them is padding, maybe a real token id such as 0)."""
    lengths = rollouts.mask.sum(-1).long().tolist()
    texts = tokenizer.batch_decode([row[:n] for row, n in zip(rollouts.tokens.tolist(), lengths)],
                                   skip_special_tokens=True)
    return torch.tensor([float(reward(text, e["answer"])) for text, e in zip(texts, examples)])


def accuracy(rewards):
    """The share of exact answers (reward 1) among rewards [N]: with a 0/1 reward their mean, with partial
    credit (pick) stricter than it."""
    return (rewards == 1).float().mean().item()


def greedy(model, tokenizer, examples, sparse, max_new_tokens, batch_size, lora=None):
    """Greedy answers to `examples` through `sparse`, `batch_size` prompts at a time; yields (the batch's
    examples, their Rollouts). By theta + phi with a `lora` adapter and a sparse cache, switched off again
    before each yield, so that what the caller computes between batches is theta alone."""
    if not examples:   # else torch.cat's "expected a non-empty list of Tensors", or an accuracy of nan
        raise ValueError("no held-out examples to evaluate: the list is empty")
    for first in range(0, len(examples), batch_size):
        batch = examples[first: first + batch_size]
        with lora.on() if lora and sparse.policy != "full" else nullcontext():
            out = generate(model, [encode_prompt(tokenizer, e["prompt"]) for e in batch], sparse, max_new_tokens,
                           temperature=0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        yield batch, out


def eval_rewards(model, tokenizer, examples, reward, sparse, max_new_tokens, lora=None):
    """The reward of the greedy answer to each held-out prompt [N], sampled through `sparse` (`greedy`)."""
    return torch.cat([rewards_of(out, batch, tokenizer, reward)
                      for batch, out in greedy(model, tokenizer, examples, sparse, max_new_tokens, BATCH, lora)])


def eval_both(model, tokenizer, examples, reward, sparse, max_new_tokens, lora=None):
    """train.py's evaluation (a line of eval.jsonl, less its step): the accuracies (exact answers) and mean
    rewards (partial credit, on pick) with a full cache and through the rollout cache `sparse`. A full
    `sparse` (--policy full) is the dense cache itself: one greedy pass gives both sides."""
    caches = (SparseConfig("full"),) if sparse.policy == "full" else (SparseConfig("full"), sparse)
    rewards = [eval_rewards(model, tokenizer, examples, reward, c, max_new_tokens, lora)
               for c in tqdm(caches, desc=f"evaluate: {'dense, sparse' if len(caches) == 2 else 'dense'}",
                             leave=False, dynamic_ncols=True)]
    dense, sampled = rewards[0], rewards[-1]
    return dict(dense=accuracy(dense), sparse=accuracy(sampled), dense_reward=dense.mean().item(),
                sparse_reward=sampled.mean().item())


def evaluate_only(model, tokenizer, examples, reward, configs, max_new_tokens, lora=None):
    """train.py --steps 0: the greedy accuracy on the held-out prompts, dense and through each cache of
    `configs`; prints it as a markdown table and returns {name: accuracy}."""
    caches = {}   # one pass a row: a full cache is the dense row's, a repeated one (--eval-budgets 8 8) the first's
    for sparse in (SparseConfig("full"), *configs):
        caches.setdefault("dense" if sparse.policy == "full" else sparse.name, sparse)
    results = {name: accuracy(eval_rewards(model, tokenizer, examples, reward, sparse, max_new_tokens, lora))
               for name, sparse in tqdm(caches.items(), desc="evaluate", leave=False, dynamic_ncols=True)}
    print(f"\n| cache | greedy accuracy on {len(examples)} held-out prompts |\n|---|---|")
    for name, value in results.items():
        print(f"| {name} | {value:.3f} |")
    return results


def pad_to(t, T):
    """[N, t, ...] -> [N, T, ...], zeros after column t (a zero mask hides them)."""
    return F.pad(t, (0, 0) * (t.dim() - 2) + (0, T - t.shape[1]))


def run_inference(model, tokenizer, examples, reward, sparse, max_new_tokens, batch_size, lora=None):
    """One row of report.py's `inference` table: greedy answers to `examples` through `sparse`, `batch_size`
    at a time; -> dict of accuracy, peak_kv_bytes (summed over batches), alpha_mean, alpha_p05 (the
    acceptance, section 4), tokens, seconds. The dense side of alpha is always theta alone."""
    start, rewards, peak, parts = clock(model.device), [], 0, []
    for batch, out in greedy(model, tokenizer, examples, sparse, max_new_tokens, batch_size, lora):
        rewards.append(rewards_of(out, batch, tokenizer, reward))
        peak += out.stats["peak_kv_bytes"]
        # greedy: the sampler recorded log-probs at temperature 1, so the dense pass uses 1 too
        logp_dense, topk_dense = C.dense_logprobs(model, out, batch_size=4, topk=True)
        parts.append([logp_dense, out.logprobs, out.mask, topk_dense, out.topk_logprobs])
    stats = C.mismatch_stats(*[torch.cat([pad_to(t, max_new_tokens) for t in column]) for column in zip(*parts)])
    return dict(accuracy=accuracy(torch.cat(rewards)), peak_kv_bytes=peak, alpha_mean=stats["alpha_mean"],
                alpha_p05=stats["alpha_p05"], tokens=stats["tokens"], seconds=clock(model.device) - start)


def main(argv=None):
    """`python evaluate.py [train.py's flags]`: train.py's evaluate-only run (--steps 0), which loads the model
    as a training run would (the toy warm-up, --model, --resume's last checkpoint) and prints its table."""
    import train   # here, not at the top: train.py imports this file
    argv = sys.argv[1:] if argv is None else argv
    argv = ["--steps", "0", *argv]
    if train.parse_args(argv, HELP, TRAINING_ONLY).steps != 0:     # a --steps of the user's came after ours
        sys.exit("error: evaluate.py never trains: drop --steps (python train.py trains)")
    return train.main(argv)


if __name__ == "__main__":
    main()
