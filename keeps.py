"""Which positions of one toy rollout each eviction policy keeps, step by step (docs/method.md section 2).

    python keeps.py --model results/runs/warmup-pick-s0 --out results/keeps.png > results/keeps.md   # as reproduce.sh does

One held-out prompt of the warm-up's task (train.py's held-out set, longer than the budget + interval, so that the
first decode step compresses it; the prefill is kept whole) is answered greedily through each policy's cache.
`kept_fractions` reads the rollout's record (`Rollouts.kept`): at each forward pass (0: the prefill), the share of
(layer, KV head) pairs that hold each position. `draw_keeps` draws one panel per policy (a PNG, --out; needs
matplotlib), each dot coloured by the token's role: a digit the answer needs, a distractor letter, another prompt
token, the answer. The table on stdout gives each policy's answer and the shares of the needed tokens and
distractors held at the last step ("-" for sort and reverse, whose prompts hold no distractor).
"""
import argparse
import sys
import time

import torch
import torch.nn.functional as F

import cli
from kvcache import POLICIES, SparseConfig
from models import load_pretrained, toy_settings
from report import pyplot
from sampler import generate
from tasks import TOY_TASKS, encode_prompt, held_out_examples


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="out/warmup", help="a toy model folder with its warmup.json (python train.py)")
    p.add_argument("--policies", nargs="+", default=["snapkv", "rkv", "h2o", "streaming", "random"],
                   choices=[p for p in POLICIES if p not in ("full", "blocktopk")], help="a panel per policy")
    p.add_argument("--budget", type=int, default=None, help="none: train.py's budget for the task")
    p.add_argument("--example", type=int, default=0, help="which held-out prompt longer than budget + interval")
    p.add_argument("--out", default="out/keeps.png", help="the PNG (needs matplotlib; without it, a warning)")
    return p.parse_args(argv)


def kept_fractions(model, tokenizer, prompt, sparse, max_new_tokens):
    """Greedy rollout of one prompt through `sparse`; -> (kept [steps, L]: the share of (layer, KV head) pairs
    that held each position at each forward pass, response token ids). Step 0 is the prefill."""
    out = generate(model, [encode_prompt(tokenizer, prompt)], sparse, max_new_tokens, temperature=0,
                   eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, record=True)
    L = len(encode_prompt(tokenizer, prompt)) + out.tokens.shape[1]
    held = torch.stack([F.one_hot(k[:, 0].clamp(min=0).long(), L + 1)[..., :L]     # (kept: int16 or int32)
                        .masked_fill((k[:, 0] < 0)[..., None], 0).amax(-2).float()
                        for k in out.kept])                           # [layers, steps, H_kv, L]: held or not
    return held.mean((0, 2)), out.tokens[0, : int(out.mask.sum())].tolist()


def held_share(kept, role, which):
    """The share of the prompt's `which` tokens held at the last step of `kept` [steps, L], as a percentage; "-"
    where the prompt has none (sort and reverse have no distractors: a mean over no token is nan)."""
    of_role = torch.tensor([r == which for r in role])
    if not of_role.any():
        return "-"
    return f"{kept[-1, :len(role)][of_role].mean().item():.0%}"


def keeps(args):
    """Draw, for one held-out prompt of the warm-up's task, which positions each policy keeps at each step."""
    settings = toy_settings(args.model, files=("warmup.json",), needs=("task", "digits", "seed"))
    run = TOY_TASKS[settings["task"]]
    cli.check_least(args, 1, ["budget"])
    cli.check_least(args, 0, ["example"])
    budget = args.budget or run["budget"]
    configs = [SparseConfig(p, budget, run["interval"], run["window"], run["sink"])
               for p in dict.fromkeys(args.policies)]                        # a policy named twice: one panel
    examples = held_out_examples(settings["task"], 256, settings["seed"], *settings["digits"])   # train.py's held-out
    long = [e for e in examples if len(e["prompt"]) + 1 > budget + run["interval"]]
    if not long:                                                      # before the model loads
        raise ValueError(f"--budget {budget}: no held-out prompt is longer than the budget + interval "
                         f"({run['interval']}), so none is compressed at the first decode step: give a smaller "
                         "--budget")
    if args.example >= len(long):
        raise ValueError(f"--example {args.example}: only {len(long)} held-out prompts are longer than the budget "
                         f"({budget}) + interval ({run['interval']})")
    model, tokenizer = load_pretrained(args.model)
    example = long[args.example]
    role = ["prompt"] + ["needed" if c.isdigit() else "distractor" if c.islower() else "prompt" for c in example["prompt"]]
    panels, rows = [], []
    for sparse in configs:
        kept, tokens = kept_fractions(model, tokenizer, example["prompt"], sparse, run["max_new_tokens"])
        answer = tokenizer.decode(tokens, skip_special_tokens=True)
        panels.append((sparse.policy, kept, answer))
        rows.append([sparse.policy, repr(answer), held_share(kept, role, "needed"),
                     held_share(kept, role, "distractor")])
    draw_keeps(panels, role, example, budget, args.out)
    title = f"Prompt {example['prompt']!r}, answer {example['answer']!r}; {settings['task']} warm-up, budget {budget}"
    header = ["policy", "its answer", "needed tokens held at the last step", "distractors held"]
    return f"{title}\n\n{cli.markdown(header, rows)}"


def draw_keeps(panels, role, example, budget, path):
    """One panel per policy: x the forward pass (0: prefill), y the position; a dot where a token is held, its
    colour the token's role and its opacity the share of layers and heads that hold it."""
    if (plt := pyplot([path])) is None:
        return
    import matplotlib.ticker
    colours = dict(needed="tab:green", distractor="tab:red", prompt="tab:grey", answer="tab:blue")
    fig, axes = plt.subplots(1, len(panels), figsize=(2.6 * len(panels), 4.2), sharey=True, squeeze=False)
    for ax, (policy, kept, answer) in zip(axes[0], panels):
        steps, positions = kept.shape
        for p in range(positions):
            r = role[p] if p < len(role) else "answer"
            alpha = kept[:, p].clamp(0, 1).numpy()
            ax.scatter(range(steps), [p] * steps, s=14, c=colours[r], alpha=alpha, linewidths=0)
        ax.set_title(f"{policy}\n-> {answer}", fontsize=9)
        ax.set_xlabel("forward pass")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    axes[0][0].set_ylabel("position")
    for r, c in colours.items():
        axes[0][-1].scatter([], [], c=c, label=r)
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{example['prompt']} -> {example['answer']} (budget {budget})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    start = time.time()
    try:
        cli.check_values(args, unchecked=("budget",))        # a --budget too big: keeps() names it
        cli.check_out_file(args.out, "a file name (a .png)")
        table = keeps(args)
    except (ValueError, OSError) as error:
        sys.exit(f"error: {error}")
    print(f"`python keeps.py {' '.join(sys.argv[1:] if argv is None else argv)}`, "
          f"wall time {(time.time() - start) / 60:.1f} min\n\n{table}")


if __name__ == "__main__":
    main()
