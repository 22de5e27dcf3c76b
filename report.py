"""Comparison tables, printed as markdown (METHOD.md sections 2 and 4).

    python report.py inference --model smollm2-135m --data ../shared/data/gsm8k/test.jsonl --limit 100 \\
        --policies snapkv rkv h2o streaming --budgets 64 128 --interval 32 > results/smollm2_gsm8k.md

`inference`: what eviction costs one model at inference time. The first --limit questions of a JSONL
file are answered greedily (256 new tokens by default) with a full cache, then under each
(policy, budget); each row gives the accuracy (`tasks.numeric_reward`), the peak KV bytes against
the dense run's, and the acceptance alpha = sum_v min(p_dense, p_sparse) over the sampler's top-k
tokens (section 4: its mean, and its 5th percentile over all response tokens, the tail statistic
that stayed >= 0.86 in stable training runs). The dense side is one teacher-forced pass over each
greedy response (`correction.dense_logprobs`), exactly the pi_old of a training step.
Progress goes to stderr, the table to stdout.
"""
import argparse
import sys
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

import correction as C
from kvcache import POLICIES, SparseConfig
from sampler import generate
from tasks import encode_prompt, load_jsonl, numeric_reward
from models import CACHE_DIR, SMOLLM2, load_pretrained
from train import rewards_of


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
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--policies", nargs="+", default=["snapkv", "rkv", "h2o", "streaming"],
                   choices=[p for p in POLICIES if p != "full"])
    g.add_argument("--budgets", type=int, nargs="+", default=[64, 128], help="tokens kept per layer and KV head")
    g.add_argument("--interval", type=int, default=32, help="compress every N tokens once over budget")
    g.add_argument("--window", type=int, default=8, help="recent tokens always kept")
    g.add_argument("--sink", type=int, default=4, help="first tokens kept by streaming")
    g.add_argument("--batch-size", type=int, default=25, help="questions decoded together")
    return p.parse_args(argv)


def pad_to(t, T):
    """[N, t, ...] -> [N, T, ...], zeros after column t (a zero mask hides them)."""
    return F.pad(t, (0, 0) * (t.dim() - 2) + (0, T - t.shape[1]))


def run_inference(model, tokenizer, examples, sparse, max_new_tokens, batch_size):
    """Greedy answers to `examples` through `sparse`; -> dict of accuracy, peak_kv_bytes (summed over
    batches), alpha_mean, alpha_p05, tokens, seconds."""
    start, rewards, peak, parts = time.perf_counter(), [], 0, []
    for first in range(0, len(examples), batch_size):
        batch = examples[first: first + batch_size]
        out = generate(model, [encode_prompt(tokenizer, e["prompt"]) for e in batch], sparse, max_new_tokens,
                       temperature=0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        rewards.append(rewards_of(out, batch, tokenizer, numeric_reward))
        peak += out.stats["peak_kv_bytes"]
        # greedy: the sampler recorded log-probs at temperature 1, so the dense pass uses 1 too
        logp_dense, topk_dense = C.dense_logprobs(model, out, batch_size=4, topk=True)
        parts.append([logp_dense, out.logprobs, out.mask, topk_dense, out.topk_logprobs])
    stats = C.mismatch_stats(*[torch.cat([pad_to(t, max_new_tokens) for t in column]) for column in zip(*parts)])
    return dict(accuracy=torch.cat(rewards).mean().item(), peak_kv_bytes=peak, alpha_mean=stats["alpha_mean"],
                alpha_p05=stats["alpha_p05"], tokens=stats["tokens"], seconds=time.perf_counter() - start)


def inference(args):
    """Check everything, load the model, run dense and each (policy, budget); -> the markdown table."""
    for name in ("limit", "max_new_tokens", "interval", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    configs = [SparseConfig("full")] + [SparseConfig(policy, budget, args.interval, args.window, args.sink)
                                        for budget in args.budgets for policy in args.policies]  # raise early
    examples = load_jsonl(args.data)[: args.limit]
    model, tokenizer = load_pretrained(args.model, args.gguf_file, args.cache_dir)
    rows = []
    for sparse in tqdm(configs, desc="configurations", dynamic_ncols=True):
        rows.append((sparse, run_inference(model, tokenizer, examples, sparse, args.max_new_tokens, args.batch_size)))
    dense = rows[0][1]
    lines = [f"{len(examples)} questions of {args.data}, greedy, {args.max_new_tokens} new tokens, "
             f"interval {args.interval}, window {args.window}, sink {args.sink}; peak KV summed over batches of "
             f"{args.batch_size} (the prompt is kept whole at prefill, so its length sets a floor); alpha over the "
             "sampler's top-20 tokens, a lower bound whose ceiling (the top-20 mass) the dense row shows", "",
             "| rollout | budget | accuracy | peak KV (MiB) | vs dense | alpha mean | alpha p05 | tokens | time (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for sparse, r in rows:
        budget = "-" if sparse.policy == "full" else sparse.budget
        lines.append(f"| {'dense' if sparse.policy == 'full' else sparse.policy} | {budget} | {r['accuracy']:.2f} "
                     f"| {r['peak_kv_bytes'] / 2**20:.1f} | {r['peak_kv_bytes'] / dense['peak_kv_bytes']:.0%} "
                     f"| {r['alpha_mean']:.3f} | {r['alpha_p05']:.3f} | {r['tokens']} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    start = time.time()
    try:
        table = inference(args)
    except ValueError as error:
        sys.exit(f"error: {error}")
    print(f"`python report.py {' '.join(sys.argv[1:] if argv is None else argv)}`, "
          f"wall time {(time.time() - start) / 60:.1f} min\n\n{table}")


if __name__ == "__main__":
    main()
