"""What sparse rollouts save and cost, measured side by side on this machine.

    python bench.py                  # the full measurement (CPU: about 38 minutes on 2 cores)
    python bench.py --quick          # the same code on a tiny model, in seconds (tests/test_bench.py)
    python bench.py --gpu --out $OUT/bench_gpu.md   # the one-GPU bench, bench_gpu.py (~4.5 minutes on an H100)
    python bench.py --model smollm2-135m   # a real pretrained model (train.py's --model), ~15 minutes

One run measures, on the CPU, and prints five markdown tables plus a JSON file (each section's function tells how):
1. Throughput: tokens per second of Hugging Face `model.generate` (its dynamic cache), our sampler with the full
   cache, with each eviction policy (budget 256, interval 128) and with block top-k, on a random Llama with
   grouped-query attention (or --model, shorter runs). Keep the machine idle: a second job stalls PyTorch's threads
   and can slow a run several times over; the runs that other processes disturbed are listed.
2. Memory: the peak KV cache of each run, against `2 * layers * kv_heads * head_dim * tokens * bytes * batch`.
3. Scaling: decode time per token around each context length, from one long rollout; also <out>_scaling.png.
4. Overheads: choosing (what to evict, or which pages) as a share of decode time; rejection + weights +
   down-sampling against one training step; dense re-scoring against the rollout.
5. The limit: the measured matmul FLOP/s and copy bandwidth, and how much of each our dense decode uses.
Timings are measurements, never assertions: no test checks a speed."""
import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import correction as C
import kvcache
from cli import check_least, check_out_file, check_values, markdown
from clocks import copy_bandwidth, eviction_clock, rate, run_clocks, timed
from cost import cost, kv_bytes, shape
from hook import SUPPORTED_MODELS
from kvcache import SparseConfig
from models import load_pretrained
from report import pyplot
from sampler import clock, generate

FULL = dict(layers=8, hidden=512, heads=8, kv_heads=2, ffn=1536, vocab=8192, batch=8, prompt=256, new=2048,
            long_new=4096, budget=256, interval=128, repeats=3, long_repeats=1, contexts=(512, 1024, 2048, 4096),
            mm=2048, keep=4)
QUICK = dict(layers=3, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, batch=4, prompt=16, new=48,
             long_new=120, budget=16, interval=8, repeats=2, long_repeats=1, contexts=(32, 64, 136), mm=256, keep=2)
# A pretrained --model: shorter runs than FULL (SmolLM2-135M decodes ~60 tokens/s at batch 8 on one CPU
# thread), its own shape filled in by build_model, and a budget that evicts within prompt + 256 new.
PRETRAINED = dict(batch=8, prompt=128, new=256, long_new=768, budget=128, interval=32, repeats=2, long_repeats=1,
                  contexts=(256, 512, 896), mm=2048, keep=4)
# The sparse samplers compared: four that evict (docs/method.md section 2), and Sparrow's block top-k (section 3),
# which keeps every token and saves attention work instead (SparseConfig's page size and dense layers).
EVICTION = ["streaming", "h2o", "snapkv", "rkv"]
SPARSE = EVICTION + ["blocktopk"]
LONG_POLICY = "snapkv"   # the eviction policy of the long rollout (scaling, 4096 + 256 target)
HF = "HF generate"
# The shape's names in the settings, and the Hugging Face config fields they stand for (Llama's and Qwen3's alike).
HF_FIELDS = dict(layers="num_hidden_layers", hidden="hidden_size", heads="num_attention_heads",
                 kv_heads="num_key_value_heads", ffn="intermediate_size", vocab="vocab_size")
# A ratio and a share as the tables print them ("1.25x", "12.5 %"); "-" where a number is missing (a skipped row).
ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "-"
pct = lambda share: f"{100 * share:.1f} %"
agreement = lambda a, b: f"{(a == b).float().mean().item():.3f}"   # the share of positions with the same token
START = time.perf_counter()


def log(message):
    """Progress on stderr (the tables go to stdout), with the seconds since start."""
    print(f"[{time.perf_counter() - START:6.0f} s] {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the model and the runs

def build_model(s):
    """A random Llama-family model shaped by `s`, or the pretrained s["model"], whose shape goes into `s`."""
    if "model" in s:
        model, _ = load_pretrained(s["model"])
        if (family := model.config.model_type) not in SUPPORTED_MODELS:   # the fields read below are theirs
            raise ValueError(f"model {s['model']!r} is a {family!r} model; supported: "
                             f"{', '.join(SUPPORTED_MODELS)} (the samplers' attention, hook.py)")
        s.update({ours: getattr(model.config, field) for ours, field in HF_FIELDS.items()})
        s["head_dim"] = getattr(model.config, "head_dim", None)       # Qwen3's is not hidden / heads (`head_dim`)
    else:
        torch.manual_seed(0)
        config = LlamaConfig(**hf_config(s), max_position_embeddings=s["prompt"] + s["long_new"])
        model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None   # every run is full length (a random model has no end token)
    return model


def random_ids(s, batch, length, device="cpu", seed=1):
    """Random prompt tokens [batch, length] (ids from 1: 0 is the pad id)."""
    return torch.randint(1, s["vocab"], (batch, length), generator=torch.Generator().manual_seed(seed)).to(device)


def greedy(model, ids, sampler, new, budget, interval, **extra):
    """Exactly `new` greedy tokens after each row of `ids`, by Hugging Face `generate` (`sampler` HF) or by our
    sampler with that policy -> (tokens, peak KV tokens, peak KV bytes, our Rollouts or None for HF)."""
    if sampler != HF:
        sparse = SparseConfig(sampler, budget=budget, interval=interval)
        out = generate(model, ids.tolist(), sparse, max_new_tokens=new, temperature=0, **extra)
        return out.tokens, out.stats["peak_kv_tokens"], out.stats["peak_kv_bytes"], out
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                             min_new_tokens=new, pad_token_id=0, return_dict_in_generate=True)
    kv = getattr(out, kvcache.CACHE_ARG)   # a dynamic cache only grows: its final size is its peak
    kv_bytes = sum(t.numel() * t.element_size() for layer in kv.layers for t in (layer.keys, layer.values))
    return out.sequences[:, ids.shape[1]:], kv.get_seq_length(), kv_bytes, None


def run(model, ids, sampler, new, s, interval=None):
    """`greedy` on the run's clocks -> dict of tokens, seconds, prefill seconds, peak KV tokens and bytes, the
    disturbance and, for ours (None for HF), seconds spent choosing, step stamps and the Rollouts."""
    with eviction_clock() as spent, run_clocks(model) as (stamps, others):
        start = clock(model.device)
        tokens, kv_tokens, kv_bytes, rollouts = greedy(model, ids, sampler, new, s["budget"], interval or s["interval"])
        end = clock(model.device)
    assert tokens.shape[1] == new, "every run must generate exactly the requested tokens"
    return dict(tokens=tokens, seconds=end - start, prefill=stamps[1] - stamps[0], rollouts=rollouts,
                peak_kv_tokens=kv_tokens, peak_kv_bytes=kv_bytes, evict_seconds=None if sampler == HF else spent[0],
                stamps=None if sampler == HF else stamps + [end], others=others[0])


def median_run(runs):
    """One summary of repeated runs: median seconds; tokens, cache sizes and stamps from the first."""
    summary = dict(runs[0], seconds=statistics.median(r["seconds"] for r in runs),
                   all_seconds=[r["seconds"] for r in runs], all_others=[r["others"] for r in runs])
    if runs[0]["evict_seconds"] is not None:  # share of decode time, median over the rounds
        summary["evict_share"] = statistics.median(r["evict_seconds"] / (r["seconds"] - r["prefill"]) for r in runs)
    return summary


# ----------------------------------------------------------------------------- the five measurements

def throughput(model, ids, s):
    """Section 1: `repeats` rounds (medians) after a short warm-up; a round runs every sampler back to back, so a
    disturbance hits all alike. Then the long rollout, dense and LONG_POLICY. -> two {name: median_run} dicts."""

    def rounds(what, names, new, repeats):
        done = []
        for i in range(repeats):   # every other round runs in reverse order, so a slow drift of the machine
            order = names if i % 2 == 0 else names[::-1]            # does not always hit the same sampler
            log(f"{what} round {i + 1} of {repeats}: {', '.join(order)}, {new} new tokens")
            done.append({name: run(model, ids, name, new, s) for name in order})
        return {name: median_run([r[name] for r in done]) for name in names}

    for name in [HF, "full"] + SPARSE:
        run(model, ids, name, min(32, s["new"]), s)
    return (rounds("throughput", [HF, "full"] + SPARSE, s["new"], s["repeats"]),
            rounds("long rollout", ["full", LONG_POLICY], s["long_new"], s["long_repeats"]))


def scaling(long, s):
    """Section 3: mean decode time per token over the `interval` steps whose context ends at each length.

    Decode step i (i >= 1) feeds one token with prompt + i tokens cached; its time runs from its own forward pass
    to the next one (sampling included). An interval-long window holds exactly one compression of the evicting
    cache, so the cost of choosing is spread as it is in a rollout."""
    table = []
    for context in s["contexts"]:
        row = dict(context=context)
        for name, r in long.items():
            stamps, first = r["stamps"], context - s["interval"] - s["prompt"] + 1
            last = min(context - s["prompt"], len(stamps) - 2)   # a context at prompt + new ends at the last step
            steps = [stamps[i + 1] - stamps[i] for i in range(max(first, 1), last + 1)]
            row[name] = 1e3 * statistics.mean(steps) / s["batch"] if steps else float("nan")
        row["ratio"] = row["full"] / row[LONG_POLICY]
        table.append(row)
    return table


def hf_config(s):
    """The Hugging Face config fields of shape `s`, the one mapping every model and formula here reads; head_dim a
    pretrained model's own (Qwen3-0.6B: 128, not its hidden / heads = 64), else hidden / heads (`cost.shape`)."""
    config = {field: s[ours] for ours, field in HF_FIELDS.items()} | dict(head_dim=s.get("head_dim"))
    config["head_dim"] = shape(config)[3]
    return config


def overheads(model, ids, results, s, repeats=50):
    """Section 4: correction vs one training step, dense re-scoring vs the rollout it re-scores (LONG_POLICY's), and
    choosing at interval 1. One training step here is the learner's part only (re-score the kept rollouts densely,
    forward with grad, loss, backward, AdamW step), not the rollout: the smallest honest denominator."""
    rollouts = results[LONG_POLICY]["rollouts"]
    rescore, logp_old = timed(lambda: C.dense_logprobs(model, rollouts, batch_size=s["batch"]), model.device)
    rewards = torch.rand(len(rollouts), generator=torch.Generator().manual_seed(0)).round()  # 0/1, one group

    def correct():   # the cheap stages of a step: down-sample, advantages, reject, reweight
        keep = C.downsample(rewards, len(rollouts), s["keep"])
        advantages, _ = C.group_advantages(rewards[keep], s["keep"])
        log_rho = logp_old[keep] - rollouts.logprobs[keep]
        mask, _ = C.rejection_mask(log_rho, rollouts.mask[keep])
        return keep, advantages, mask, C.importance_weights(log_rho, rollouts.mask[keep])
    times = [timed(correct, model.device)[0] for _ in range(repeats)]
    keep, advantages, mask, weights = correct()   # the same every time: the rewards are fixed
    learner = copy.deepcopy(model).train()   # the step changes weights; the measured model stays as it was
    optimizer = torch.optim.AdamW(learner.parameters(), lr=1e-6)
    kept = rollouts.select(keep)
    start = clock(model.device)
    old = C.dense_logprobs(learner, kept, batch_size=s["batch"])
    loss, _ = C.policy_loss(C.response_logprobs(learner, kept), old, advantages, mask, weights)
    loss.backward()
    optimizer.step()
    step = clock(model.device) - start
    over = dict(correction_seconds=statistics.median(times), train_step_seconds=step, rescore_seconds=rescore,
                rescore_vs_dense_rollout=rescore / results["full"]["seconds"],
                rescore_vs_rollout=rescore / results[LONG_POLICY]["seconds"], interval_1={})
    # Interval 1 compresses at every step once over budget: a quarter of the rollout already shows that steady
    # state, at a quarter of the cost; in snapkv and rkv, the choice costs real work at every compression.
    for name in ("snapkv", "rkv"):
        log(f"{name} at interval 1")
        over["interval_1"][name] = median_run([run(model, ids, name, s["new"] // 4, s, interval=1)])["evict_share"]
    return over


def limit(s, dense, repeats=5):
    """Section 5: measured mm FLOP/s and copy bandwidth, and our dense decode's share of each.

    FLOPs and bytes are the cost model's (`cost.cost`, section 6), summed over the rollout: 2 FLOPs per
    multiply-add of the matrix products only (every linear layer's weights, the output layer included, and q.k and
    p.v over the context); norms, rotary, softmax and sampling are not counted. Bytes: every pass (the prefill,
    then each decode step) reads all linear weights once and the whole KV cache once, in fp32."""
    n, B, config = s["mm"], s["batch"], hf_config(s)
    a, b = torch.randn(n, n), torch.randn(n, n)
    fed = s["prompt"] + s["new"] - 1                       # every token but the last passes the model once
    flops = sum(cost(config, c, batch=B)["flops"] for c in range(1, fed + 1))   # token by token: causal attention
    traffic = sum(cost(config, c, batch=B, bytes_per=4)["bytes"] for c in range(s["prompt"], fed + 1))
    return dict(mm_flops=rate(2 * n ** 3, lambda: torch.mm(a, b), repeats=repeats),
                copy_bytes_per_s=copy_bandwidth(32 * n * n, repeats=repeats),
                decode_flops=flops / dense["seconds"], flops_per_token=flops / (B * fed),
                decode_bytes_per_s=traffic / dense["seconds"])


# ----------------------------------------------------------------------------- the report

def report(s, results, long, scale, over, lim, wall, machine):
    """Build the printed tables and the JSON record from the measurements."""
    B, new, dense, hf = s["batch"], s["new"], results["full"], results[HF]["tokens"]
    speed = {name: B * new / r["seconds"] for name, r in results.items()}
    long_speed = {name: B * s["long_new"] / r["seconds"] for name, r in long.items()}
    rows, memory, record = [], [], dict(settings=dict(s), machine=machine, throughput={}, scaling=scale,
                                        overheads=over, limit=lim, wall_seconds=wall, long={})
    for name, r in results.items():
        label = name if name == HF else f"ours {name}"
        formula = kv_bytes(hf_config(s), r["peak_kv_tokens"], B, 4)   # section 2, fp32
        kv = f"{r['peak_kv_bytes'] / dense['peak_kv_bytes']:.3f}"
        rows.append([label, f"{speed[name]:.1f}", ratio(speed[name], speed[HF]), ratio(speed[name], speed["full"]), kv,
                     pct(r["evict_share"]) if name in SPARSE else "-",
                     "-" if name == HF else agreement(r["tokens"], hf)])
        memory.append([label, r["peak_kv_tokens"], f"{r['peak_kv_bytes'] / 2**20:.2f}", f"{formula / 2**20:.2f}",
                       "yes" if formula == r["peak_kv_bytes"] else "NO", kv])
        record["throughput"][name] = dict(
            tokens_per_s=speed[name], vs_hf=speed[name] / speed[HF], vs_dense=speed[name] / speed["full"],
            seconds=r["all_seconds"], peak_kv_tokens=r["peak_kv_tokens"], peak_kv_bytes=r["peak_kv_bytes"],
            kv_formula_bytes=formula, evict_share=r.get("evict_share"), others_load=r["all_others"],
            same_tokens_as_hf=None if name == HF else bool(torch.equal(r["tokens"], hf)))
    for name, r in long.items():
        vs_dense, kv = long_speed[name] / long_speed["full"], r["peak_kv_bytes"] / long["full"]["peak_kv_bytes"]
        rows.append([f"ours {name}, {s['long_new']} new", f"{long_speed[name]:.1f}", "-", f"{vs_dense:.2f}x",
                     f"{kv:.3f}", pct(r["evict_share"]) if name != "full" else "-", "-"])
        record["long"][name] = dict(tokens_per_s=long_speed[name], vs_dense=vs_dense, seconds=r["all_seconds"],
                                    peak_kv_bytes=r["peak_kv_bytes"], others_load=r["all_others"])
    # Runs during which other processes kept a tenth of a core or more busy: their times are suspect.
    record["disturbed_runs"] = disturbed = [f"{name} {i + 1} ({load:.1f})" for group in (results, long)
                                            for name, r in group.items() for i, load in enumerate(r["all_others"])
                                            if load is not None and load >= 0.1]
    step = over["train_step_seconds"]
    correction = f"{100 * over['correction_seconds'] / step:.4f} %"   # of one training step
    over_rows = [["rejection + weights + down-sampling", f"{1e3 * over['correction_seconds']:.3f} ms",
                  f"one training step {step:.2f} s", correction],
                 ["dense re-scoring (pi_old) of the batch", f"{over['rescore_seconds']:.2f} s",
                  f"the {LONG_POLICY} rollout, the dense rollout",
                  f"{over['rescore_vs_rollout']:.2f}x, {over['rescore_vs_dense_rollout']:.2f}x"]]
    choosing = {name: "pages, every step" if name not in EVICTION else f"evict, interval {s['interval']}" for name in SPARSE}
    over_rows += [[f"choosing, {name} ({choosing[name]})", "-", "decode time", pct(results[name]["evict_share"])]
                  for name in SPARSE]
    over_rows += [[f"choosing, {name} (evict, interval 1; {new // 4} new)", "-", "decode time", pct(share)]
                  for name, share in over.get("interval_1", {}).items()]
    lim_rows = [[f"matmul FLOP/s (torch.mm {s['mm']}^3, fp32)", f"{lim['mm_flops'] / 1e9:.1f} G",
                 f"{lim['decode_flops'] / 1e9:.2f} G ({lim['flops_per_token'] / 1e6:.1f} MFLOP/token)",
                 pct(lim["decode_flops"] / lim["mm_flops"])],
                ["memory bytes/s (tensor copy)", f"{lim['copy_bytes_per_s'] / 1e9:.1f} G",
                 f"{lim['decode_bytes_per_s'] / 1e9:.1f} G", pct(lim["decode_bytes_per_s"] / lim["copy_bytes_per_s"])]]
    worst, chooser = min(EVICTION, key=speed.get), max(EVICTION, key=lambda n: results[n]["evict_share"])
    kv_tokens = max(results[n]["peak_kv_tokens"] for n in EVICTION)
    targets = [["dense >= 1.0x HF generate, same tokens", f"{ratio(speed['full'], speed[HF])}, tokens equal: "
                f"{record['throughput']['full']['same_tokens_as_hf']}"],
               [f"eviction >= 1.5x dense at {s['prompt']}+{new} (slowest: {worst})", ratio(speed[worst], speed["full"])],
               [f"peak KV <= ({s['budget']}+{s['interval']})/{s['prompt'] + new - 1} of dense",   # over dense's peak
                f"{kv_tokens} of {dense['peak_kv_tokens']} tokens = {kv_tokens / dense['peak_kv_tokens']:.4f} (bound "
                f"{(s['budget'] + s['interval']) / (s['prompt'] + new - 1):.4f}; dense never feeds its last token)"],
               [f"{LONG_POLICY} >= 2x dense at {s['prompt']}+{s['long_new']}",
                ratio(long_speed[LONG_POLICY], long_speed["full"])],
               [f"choosing what to evict < 10 % of decode at interval {s['interval']} (most: {chooser})",
                pct(results[chooser]["evict_share"])],
               ["rejection + weights + down-sampling < 1 % of a step", correction]]
    tables = [f"Machine: {machine}. Model: {s.get('model', 'random Llama')}, {s['layers']} layers, {s['hidden']} wide, "
              f"{s['heads']} heads / {s['kv_heads']} KV heads, vocabulary {s['vocab']}, fp32. Batch {B}, prompt "
              f"{s['prompt']}, greedy; eviction budget {s['budget']}, interval {s['interval']}; block top-k: the same "
              f"budget in pages of {SparseConfig.page_size}, first {SparseConfig.dense_layers} layers dense.",
              f"### 1. Throughput ({new} new tokens, median of {s['repeats']} rounds; long rows: {s['long_new']} new, "
              f"{s['long_repeats']} round)",
              markdown(["sampler", "tokens/s", "vs HF", "vs dense", "peak KV vs dense", "choosing", "same tokens as HF"], rows),
              "Runs disturbed by other processes (run number, cores they kept busy): " + (", ".join(disturbed) or "none")
              + (". Rerun on an idle machine before trusting the ratios." if disturbed else "."),
              "### 2. Memory: peak KV cache, checked against 2 * layers * kv_heads * head_dim * tokens * 4 bytes * batch",
              markdown(["cache", "peak tokens", "peak MiB", "formula MiB", "match", "vs dense"], memory),
              f"### 3. Scaling: decode ms per token, mean over the {s['interval']} steps up to each context",
              markdown(["context", "dense", LONG_POLICY, "dense / " + LONG_POLICY],
                       [[r["context"], f"{r['full']:.3f}", f"{r[LONG_POLICY]:.3f}", f"{r['ratio']:.2f}x"] for r in scale]),
              "### 4. Overheads", markdown(["what", "time", "against", "share"], over_rows),
              "### 5. The limit (FLOPs: matrix products only; bytes: all weights + the whole KV cache per step)",
              markdown(["measure", "machine", "our dense decode", "fraction"], lim_rows),
              "### Targets", markdown(["target", "measured"], targets), f"Total wall time: {wall:.0f} s."]
    return "\n\n".join(tables), dict(record, targets=dict(targets))


def plot_scaling(scale, path):
    """Section 3 as a PNG next to the JSON file; without matplotlib (it is optional), a warning."""
    if (plt := pyplot([path])) is None:
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, label in (("full", "dense"), (LONG_POLICY, LONG_POLICY)):
        ax.plot([r["context"] for r in scale], [r[name] for r in scale], marker="o", label=label)
    ax.set(xlabel="context (tokens)", ylabel="decode ms per token", title="Decode time against context", ylim=(0, None))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cpu_name():
    """The processor this bench runs on, a GPU beside it or not: its model (from Linux's /proc/cpuinfo; "CPU"
    where that cannot be read) and core count."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "CPU")
    return f"{name} ({os.cpu_count()} cores)"


def out_files(out, gpu):
    """The files a run writes, --out first: the JSON, the tables beside it as .md and the scaling plot; with --gpu
    bench_gpu.py's markdown and the JSON beside it. Each is opened now (ValueError), not after the measurements."""
    stem = os.path.splitext(out)[0]
    files = [out, str(Path(out).with_suffix(".json"))] if gpu else [out, stem + ".md", stem + "_scaling.png"]
    if out in files[1:]:   # one would overwrite the other, silently
        raise ValueError(f"--out {out!r}: " + ("with --gpu it names the markdown, and the JSON goes beside it as "
                         ".json: give a .md name" if gpu else "it names the JSON, and the tables go beside it as "
                         ".md: give a .json name (--gpu writes the markdown)"))
    for path in files:
        there = os.path.exists(path)
        try:
            open(path, "a").close()   # "a": a file there (an earlier run's) keeps its contents until it is replaced
        except OSError as error:
            raise ValueError(f"--out {out!r}: cannot write {path!r}: {error.strerror}") from None
        if not there:
            os.remove(path)
    return files


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, seconds instead of minutes")
    parser.add_argument("--gpu", action="store_true", help="the one-GPU bench instead (bench_gpu.py; --quick: tiny)")
    parser.add_argument("--out", default=None, help="the JSON record, its tables beside it as .md (default results/"
                        "bench.json; bench_quick.json with --quick); with --gpu the markdown, the JSON beside it "
                        "(default results/bench_gpu.md; bench_gpu_quick.md with --quick)")
    parser.add_argument("--repeats", type=int, default=None, help="rounds of the throughput runs (median)")
    parser.add_argument("--deadline", type=float, default=None, help="with --gpu: seconds after which rows not yet "
                        "begun are skipped (none: bench_gpu.GPU's 300, --quick 600)")
    parser.add_argument("--model", default=None, help="a pretrained model instead of the random one: HF "
                        "folder, hub id, GGUF file or smollm2-135m (see models.py); JSON: results/bench_<name>.json")
    args = parser.parse_args(argv)
    if args.quick and args.model:
        parser.error("--quick runs the tiny random model; it cannot be combined with --model")
    for name in ("model", "repeats"):
        if args.gpu and getattr(args, name) is not None:
            parser.error(f"--gpu takes --quick, --out and --deadline only, not --{name}")
    if args.deadline is not None and not (args.gpu and args.deadline >= 0):
        parser.error(f"--deadline goes with --gpu and must be >= 0, got {args.deadline}"
                     + ("" if args.gpu else " without --gpu"))
    # a model's JSON takes its whole name, less .gguf: the stem cut Qwen3-0.6B and Qwen3-0.6B-Base to "Qwen3-0"
    name = args.model and Path(os.path.abspath(args.model)).name.removesuffix(".gguf")
    default = "bench_gpu" if args.gpu else f"bench_{name}" if args.model else "bench"   # bench_gpu.py's too
    out = args.out or f"results/{default}{'_quick' if args.quick else ''}{'.md' if args.gpu else '.json'}"
    try:                                                              # now, not after the bench
        check_values(args, unchecked=("deadline",))                   # --deadline inf: no deadline
        check_least(args, 1, ["repeats"])
        check_out_file(out)                                           # every default lies in results/; --gpu's too
        files = out_files(out, args.gpu)
    except ValueError as error:
        parser.error(str(error))
    if args.gpu:   # imported here, not at the top: bench_gpu builds on this module
        import bench_gpu
        return bench_gpu.main(args)
    s = dict(QUICK) if args.quick else dict(PRETRAINED, model=args.model) if args.model else dict(FULL)
    s["repeats"] = args.repeats or s["repeats"]
    wall, machine = time.perf_counter(), f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    try:
        model = build_model(s)
    except ValueError as error:                                     # a --model not there, or of another family
        parser.error(str(error))
    ids = random_ids(s, s["batch"], s["prompt"])
    results, long = throughput(model, ids, s)
    scale = scaling(long, s)
    log("overheads: dense re-scoring, correction, one training step")
    over = overheads(model, ids, results, s)
    log("the limit: torch.mm and copy bandwidth")
    lim = limit(s, results["full"])
    text, record = report(s, results, long, scale, over, lim, time.perf_counter() - wall, machine)
    record["table"] = text
    print(text)
    json_file, md_file, png_file = files
    Path(json_file).write_text(json.dumps(record, indent=1, default=str))
    Path(md_file).write_text(text + "\n")                                   # the tables as printed
    plot_scaling(scale, png_file)
    return record


if __name__ == "__main__":
    main()
