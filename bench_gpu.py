"""One GPU, proven: what sparse rollouts buy a 1.7B model on one card, in one command of about 5 minutes.

    PYTHONUNBUFFERED=1 python bench.py --gpu --out $OUT/bench_gpu.md 2>&1 | tee $OUT/bench_gpu.log
    python bench.py --gpu --quick    # the same code on a tiny shape, in seconds, on any device (tests/test_bench_gpu.py)

Its own file because it asks bench.py's questions at a scale where bench.py's method does not fit the time: an
eager decode step of ours at this shape and batch 64 took ~41 ms on an H100 (HF's ~120 ms), a minute per rollout,
so no row runs a whole rollout. Instead:
- A sampler that keeps every token (HF `generate`, our dense, block top-k) is timed over `window` decode steps
  centred on the mean context of the rollout it stands for (prefill to there, `warm` steps, then the window):
  its step cost grows linearly with the context, so that is its mean step cost over the rollout.
- An evicting sampler is timed in its steady state: from the real prompt, past its first compression, over a
  window of `interval` steps, which holds exactly one compression. That state, and its cost, are the same at
  every length past budget + interval, so one row stands for 512 + 1536 and 512 + 4096 alike.
- Peak memory is `torch.cuda.max_memory_allocated` of the measured run, beside the weights + the KV formula.
- The memory-to-throughput rows find the largest batch of a 512 + 8192 rollout by allocating it (prefill and
  a few decode steps with the cache sized for the whole rollout; doubling, then bisection), then time each
  cache at its own batch over the same steps.
- A captured row (static.py, CUDA graphs) is timed the same way; its window pays for the graphs it captures.
Every timing reads `sampler.clock(device)` (synchronised). Rows are written to --out as they complete, and rows
not begun by `deadline` seconds (--deadline) as skipped (a session has 15 minutes of device time: gpu_check.sh), and
a row that fails as its error, the rest still measured (`attempt`); progress goes to stderr. Measurements, never
assertions."""
import json
import time
import traceback
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import bench
from bench import EVICTION, HF, LONG_POLICY, agreement, greedy, hf_config, log, pct, random_ids, ratio
from cli import markdown
from clocks import copy_bandwidth, forward_calls, peak_bytes, reset_peak, timed
from correction import ALPHA_TOPK, dense_logprobs
from cost import kv_bytes
from kvcache import KVCache, SparseConfig
from policies import attended_pages
from sampler import Rollouts, clock, generate

# ----------------------------------------------------------------------------- settings
GPU = dict(
    layers=28, hidden=2048, heads=16, kv_heads=8, ffn=6144, vocab=151936,  # Qwen3-1.7B: head_dim 128, tied embeddings
    batch=64, prompt=512, new=1536, long_new=4096,  # the rollouts table 1 stands for: 512 + 1536 and 512 + 4096
    budget=512, interval=128,                       # eviction (and block top-k's budget)
    warm=8, window=128,                 # decode steps before the timed window, and in it (one interval)
    search_new=8192, search_budget=1024, search_cap=1024, fit_steps=2,   # memory to throughput at 512 + 8192
    rescore_rows=32, rescore_tokens=4096, rescore_batches=(32, 8, 1),    # dense re-scoring, real vocabulary
    copy_mib=2048, deadline=300,        # bandwidth buffer; seconds after which rows not yet begun are skipped
    # (--deadline; the whole bench took 260 s on an H100: the deadline bites on a slower card, and the longest row
    # took 35 s there, so the bench ends inside gpu_check.sh's limit; past it, SIGINT still writes the JSON)
    shape=bench.FULL)                   # bench.py's own shape, for its HF-vs-dense pair
TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=512, batch=4, prompt=32, new=64, long_new=128,
            budget=32, interval=8, warm=4, window=16, search_new=96, search_budget=48, search_cap=16, fit_steps=2,
            rescore_rows=4, rescore_tokens=64, rescore_batches=(4, 2), copy_mib=16, deadline=600, shape=bench.QUICK)
DTYPE = torch.bfloat16
# The rows of table 1, in the order they run: (sampler, the rollout it stands for: "new" 512 + 1536, "long_new"
# 512 + 4096, "any" every length past budget + interval; extra generate() arguments). HF and our dense run first,
# so every later row has its ratios; then the captured decode step (static.py), dense before eviction.
CAPTURED = {"captured": True}
ROWS = [(HF, "new", {}), ("full", "new", {}), (HF, "long_new", {}), ("full", "long_new", {}),
        ("streaming", "any", {}), ("h2o", "any", {}), ("snapkv", "any", {}), ("rkv", "any", {}),
        ("blocktopk", "new", {}), ("blocktopk", "long_new", {}), ("full", "new", CAPTURED),
        ("full", "long_new", CAPTURED), ("snapkv", "any", CAPTURED), ("h2o", "any", CAPTURED),
        ("blocktopk", "new", CAPTURED), ("blocktopk", "long_new", CAPTURED)]


# ----------------------------------------------------------------------------- the model

def qwen3_model(s, device):
    """A random Qwen3 of shape `s` (`bench.hf_config`'s head_dim, tied embeddings) in bf16 on `device`, eval mode."""
    torch.manual_seed(0)
    config = Qwen3Config(**hf_config(s), tie_word_embeddings=True, eos_token_id=None,
                         max_position_embeddings=s["prompt"] + s["search_new"])
    with torch.device(device):   # initialised where it runs: 1.7B parameters are slow to initialise on a CPU
        model = Qwen3ForCausalLM(config)
    model = model.to(DTYPE).eval()
    model.generation_config.eos_token_id = None   # every run is full length
    return model


class Enough(Exception):
    """Raised from a forward hook by `fits` to end a rollout early: a fit test needs its allocations, not its tokens."""


# ----------------------------------------------------------------------------- one timed window

def window_run(model, s, sampler, prompt_len, steps, budget=None, batch=None, **extra):
    """Decode `steps` greedy tokens after `prompt_len` random ones (`extra` goes to generate); time the last `window`.

    Returns dict: tokens_per_s (batch * window / synchronised seconds), step_s, peak_bytes (None on a CPU),
    kv_tokens (the most the cache held), tokens [batch, steps], run_seconds (the whole call's wall time)."""
    device, batch, wall = model.device, batch or s["batch"], time.perf_counter()
    ids = random_ids(s, batch, prompt_len, device)
    start = []
    reset_peak(device)
    with forward_calls(model, steps - s["window"], lambda: start.append(clock(device)), hf=sampler == HF):
        tokens, kv_tokens, _, _ = greedy(model, ids, sampler, steps, budget or s["budget"], s["interval"], **extra)
        seconds = clock(device) - start[0]
    return dict(tokens_per_s=batch * s["window"] / seconds, step_s=seconds / s["window"], peak_bytes=peak_bytes(device),
                kv_tokens=kv_tokens, tokens=tokens, run_seconds=time.perf_counter() - wall)


def plan(s, sampler, length, budget=None):
    """(prompt length, decode steps, the window's first context) of a row, as the module docstring says."""
    if sampler in EVICTION:   # the first compression feeds call budget + interval - prompt; then steady state
        skip = max(1, (budget or s["budget"]) + s["interval"] - s["prompt"]) + s["warm"]
        return s["prompt"], skip + s["window"], s["prompt"] + skip
    prompt_len = s["prompt"] + s[length] // 2 - s["window"] // 2 - s["warm"]
    return prompt_len, s["warm"] + s["window"], prompt_len + s["warm"]


def kv_read_bytes(s, sampler, context, batch, budget=None):
    """Bytes of keys and values one decode step reads over all layers, at a mean `context`, in bf16."""
    budget, D, L = budget or s["budget"], hf_config(s)["head_dim"], s["layers"]
    per_token = 2 * s["kv_heads"] * D * 2 * batch          # K and V of one layer, every row
    if sampler in EVICTION:                                # it holds budget .. budget + interval: mean in between
        return L * per_token * (budget + s["interval"] / 2)
    if sampler == "blocktopk":   # dense layers read all; the rest their chosen pages + the 2 newest + the first,
        page, dense = SparseConfig.page_size, SparseConfig.dense_layers   # and the fp32 page key sums they score
        chosen = min(context, attended_pages(budget, page) * page)
        sums = context / page * s["kv_heads"] * D * 4 * batch
        return per_token * (dense * context + (L - dense) * chosen) + (L - dense) * sums
    return L * per_token * context


def rollout_kv_tokens(s, sampler, new, budget=None):
    """Tokens per layer and KV head the cache holds at its peak in a whole prompt + `new` rollout: the slots
    `KVCache.capacity` gives it (the last token is sampled, never fed)."""
    sparse = SparseConfig("full" if sampler == HF else sampler, budget or s["budget"], s["interval"])
    return KVCache(sparse, 1, new - 1).capacity(s["prompt"])


# ----------------------------------------------------------------------------- the report, row by row

def size(n):
    """Bytes as GiB (or MiB below 1 GiB), or n/a."""
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


class Report:
    """The markdown file, written a line at a time and flushed, so a run that is cut short keeps its rows."""

    def __init__(self, path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "w")

    def write(self, text):
        self.file.write(text + "\n")
        self.file.flush()

    def table(self, title, header, rows=()):
        self.width = len(header)
        self.write(f"\n{title}\n\n" + markdown(header, rows))

    def row(self, cells):
        self.write("| " + " | ".join(map(str, cells)) + " |")

    def unmeasured(self, cells, why):
        """A row with no measurement: `cells`, then why not (skipped, an error), then "-" to the table's width."""
        self.row([*cells, why] + ["-"] * (self.width - len(cells) - 1))


# ----------------------------------------------------------------------------- the measurements

def late(s):
    """Whether the run is past its deadline: then the remaining rows are written as skipped."""
    return time.perf_counter() > s["stop_at"]


def attempt(record, report, label, cells, measure, settings=None):
    """measure(), or None where it raises: the error (its traceback on stderr) goes into record["errors"] and
    its row (`cells`, then the error), and what it held is freed, so that one broken row costs only itself: the
    rows and tables after it and the targets are still measured, in the one device call a session has. A time
    limit's SIGINT still ends the run. Given `settings`, a row past their deadline is written as skipped
    instead, and None returned (table 2 checks the deadline once, before it builds its model, not per row)."""
    if settings is not None and late(settings):
        report.unmeasured(cells, "skipped: past the deadline")
        return None
    try:
        return measure()
    except Exception as error:
        traceback.print_exc()
        record["errors"][label] = f"{type(error).__name__}: {error}".split("\n")[0]
        log(f"{label}: {record['errors'][label]}")
    reset_peak(record["device"])
    report.unmeasured(cells, f"error: {record['errors'][label]}")
    return None


def measure_row(model, s, sampler, length, extra, bandwidth, weights):
    """One row of table 1: `window_run` as `plan` says, plus the bandwidth share and the KV formulas (bf16)."""
    prompt_len, steps, first = plan(s, sampler, length)
    log(f"table 1: {sampler} {extra}, {length}: prompt {prompt_len}, {steps} steps")
    r = window_run(model, s, sampler, prompt_len, steps, **extra)
    read = weights + kv_read_bytes(s, sampler, first + s["window"] / 2, s["batch"])
    whole = rollout_kv_tokens(s, sampler, s["new" if length == "any" else length])
    return dict(r, steps=steps, first=first, bandwidth_share=read / r["step_s"] / bandwidth,
                kv_formula_bytes=kv_bytes(hf_config(s), r["kv_tokens"], s["batch"]),   # bf16: cost.kv_bytes's 2 bytes
                rollout_kv_bytes=kv_bytes(hf_config(s), whole, s["batch"]))


def row_label(sampler, extra):
    """A row's name: "HF generate", or "ours snapkv" with its extra arguments ("ours full captured=True")."""
    return sampler if sampler == HF else " ".join([f"ours {sampler}"] + [f"{k}={v}" for k, v in extra.items()])


def table_1(model, s, report, record, bandwidth, weights):
    """The rows of ROWS at batch `s["batch"]`: tokens/s, ratios, peak memory, KV formulas, bandwidth bound."""
    report.table(f"### 1. Throughput and memory, batch {s['batch']}, prompt {s['prompt']}, eviction budget "
                 f"{s['budget']}, interval {s['interval']}; {s['window']} timed decode steps a row",
                 ["sampler", "stands for", "timed", "tokens/s", "vs HF", f"vs dense {s['prompt']}+{s['new']}",
                  f"vs dense {s['prompt']}+{s['long_new']}", "peak GPU", "weights + KV (formula)",
                  "KV of the whole rollout (formula)", "of the bandwidth bound", "tokens = HF"])
    rows = record["rows"]
    speed = lambda label, length: rows.get(f"{label} {length}", {}).get("tokens_per_s")
    for sampler, length, extra in ROWS:
        label, dense = row_label(sampler, extra), row_label("full", extra)   # captured rows: against dense captured
        stands = "any length" if length == "any" else f"{s['prompt']}+{s[length]}"
        r = attempt(record, report, f"table 1: {label} {length}", [label, stands],
                    lambda: measure_row(model, s, sampler, length, extra, bandwidth, weights), settings=s)
        if r is None:
            continue
        rows[f"{label} {length}"] = r
        hf = rows.get(f"{HF} {length}", {}).get("tokens")
        same = "-" if sampler == HF or hf is None else agreement(r["tokens"], hf)
        window = f"{r['steps'] - s['window']}-{r['steps']}"
        timed_what = (f"steps {window} from {s['prompt']} (holds {s['budget']}-{s['budget'] + s['interval']})"
                      if sampler in EVICTION else f"context {r['first']}-{r['first'] + s['window']}")
        vs_dense = [ratio(r["tokens_per_s"], speed(dense, n)) if length in (n, "any") else "-"
                    for n in ("new", "long_new")]
        report.row([label, stands, timed_what, f"{r['tokens_per_s']:.0f}", ratio(r["tokens_per_s"], speed(HF, length)),
                    *vs_dense, size(r["peak_bytes"]), size(weights + r["kv_formula_bytes"]), size(r["rollout_kv_bytes"]),
                    pct(r["bandwidth_share"]), same])


def table_2(s, report, record, device):
    """bench.py's own shape, random Llama in bf16 on this device: HF generate against our dense sampler."""
    shape = dict(s["shape"], warm=s["warm"], window=s["window"])
    report.table(f"### 2. bench.py's own shape ({shape['layers']} layers, {shape['hidden']} wide, batch "
                 f"{shape['batch']}, {shape['prompt']}+{shape['new']}), bf16", ["sampler", "timed", "tokens/s", "vs HF"])
    if late(s):
        report.unmeasured([], "skipped: past the deadline")
        return
    model = bench.build_model(shape).to(device, DTYPE)
    for sampler in (HF, "full"):
        prompt_len, steps, first = plan(shape, sampler, "new")
        label, timed_what = sampler if sampler == HF else "ours full", f"context {first}-{first + shape['window']}"
        log(f"table 2: {sampler}, prompt {prompt_len}, {steps} steps")
        r = attempt(record, report, f"table 2: {label}", [label, timed_what],
                    lambda: window_run(model, shape, sampler, prompt_len, steps))
        if r is None:
            continue
        record["shape"][sampler] = r["tokens_per_s"]
        report.row([label, timed_what, f"{r['tokens_per_s']:.0f}", ratio(r["tokens_per_s"], record["shape"].get(HF))])


def table_3(model, s, report, record):
    """Dense re-scoring (`correction.dense_logprobs`, topk=True as train.py calls it) of rescore_rows rows of
    rescore_tokens tokens (prompt + response), at each micro-batch: peak memory, or where it ran out, and the
    seconds of a second, warm run."""
    device, N, T, k = model.device, s["rescore_rows"], s["rescore_tokens"] - s["prompt"], ALPHA_TOPK
    report.table(f"### 3. Dense re-scoring, {N} rows x {s['rescore_tokens']} tokens ({s['prompt']} prompt + {T} "
                 f"response), vocabulary {s['vocab']}",
                 ["micro-batch", "peak GPU", "logits of one micro-batch unchunked, fp32 (formula)", "seconds"])
    ids = random_ids(s, N, s["prompt"] + T, device, seed=2)
    zeros = torch.zeros(N, T, device=device)
    rollouts = Rollouts(ids[:, :s["prompt"]].tolist(), ids[:, s["prompt"]:], torch.ones(N, T, device=device), zeros,
                        zeros[..., None].expand(N, T, k), ids[:, s["prompt"]:, None].expand(N, T, k))
    for batch in s["rescore_batches"]:
        def rescore():   # running out of memory is a measurement here, not an error
            log(f"table 3: re-scoring at micro-batch {batch}")
            reset_peak(device)
            try:   # an untimed run first: first use (kernels, the allocator's pool) is off the clock, as in training
                dense_logprobs(model, rollouts, batch_size=batch, topk=True)   # after its first step; same peak
                seconds, _ = timed(lambda: dense_logprobs(model, rollouts, batch_size=batch, topk=True), device)
                return seconds, peak_bytes(device)
            except torch.OutOfMemoryError:
                return None, "out of memory"
        measured = attempt(record, report, f"table 3: micro-batch {batch}", [batch], rescore, settings=s)
        if measured is None:
            continue
        seconds, peak = measured
        record["rescore"][batch] = dict(seconds=seconds, peak_bytes=peak)
        report.row([batch, peak if seconds is None else size(peak), size(batch * T * s["vocab"] * 4),
                    "-" if seconds is None else f"{seconds:.2f}"])


def fits(model, s, sparse, batch, peaks):
    """Whether `batch` rows of a prompt + search_new rollout fit: the prefill and `fit_steps` decode steps with the
    cache sized for the whole rollout (dense: every slot at the prefill; eviction: budget + interval slots)."""
    def stop():
        raise Enough
    ids, fitted = random_ids(s, batch, s["prompt"], model.device).tolist(), True
    reset_peak(model.device)
    try:
        with forward_calls(model, 1 + s["fit_steps"], stop):
            generate(model, ids, sparse, max_new_tokens=s["search_new"], temperature=0)
    except Enough:
        pass
    except torch.OutOfMemoryError:
        fitted = False
    if fitted:
        peaks[batch] = peak_bytes(model.device)
    reset_peak(model.device)   # out of the except block: what a failed try held is free now
    return fitted


def largest_batch(fits, start, cap):
    """The largest batch in [1, cap] for which `fits(batch)` holds (fits must be monotone): doubling from `start`,
    then bisection until the gap is at most 1/16 of what fits. -> (batch, [(batch tried, fitted), ...])."""
    tries = []

    def test(batch):
        tries.append((batch, fits(batch)))
        return tries[-1][1]
    low, high, batch = 0, None, min(start, cap)
    while high is None and low < cap:
        if test(batch):
            low, batch = batch, min(2 * batch, cap)
        else:
            high = batch
    while high is not None and high - low > max(1, low // 16):
        middle = (low + high) // 2
        low, high = (middle, high) if test(middle) else (low, middle)
    return low, tries


def measure_batch(model, s, sampler, steps, context, bandwidth, weights):
    """One row of table 4: the largest batch that fits (`fits`, `largest_batch`), then `window_run` at that batch;
    if the timed run, which passes a compression, does not fit after all, at 1/16 less until it does."""
    budget, peaks = s["search_budget"], {}
    sparse = SparseConfig(sampler, budget=budget, interval=s["interval"])
    log(f"table 4: {sampler}: searching the largest batch")
    batch, tries = largest_batch(lambda b: fits(model, s, sparse, b, peaks), s["batch"], s["search_cap"])
    row = dict(batch=batch, found=batch, tries=tries, fit_peak_bytes=peaks.get(batch), tokens_per_s=None)
    while batch and not late(s):
        log(f"table 4: {sampler}: {steps} steps at batch {batch}")
        try:
            row.update(window_run(model, s, sampler, s["prompt"], steps, budget=budget, batch=batch), batch=batch)
            break
        except torch.OutOfMemoryError:
            batch -= max(1, batch // 16)
    reset_peak(model.device)
    if row["tokens_per_s"]:
        row["bandwidth_share"] = (weights + kv_read_bytes(s, sampler, context, batch, budget)) / row["step_s"] / bandwidth
    return row


def table_4(model, s, report, record, bandwidth, weights):
    """Memory to throughput: each cache's largest batch at prompt + search_new, and the tokens/s it reaches there."""
    budget = s["search_budget"]
    _, steps, first = plan(s, LONG_POLICY, "new", budget)
    report.table(f"### 4. Memory to throughput: the largest batch whose {s['prompt']}+{s['search_new']} rollout fits "
                 f"(found by allocating it, cap {s['search_cap']}), and the tokens/s at that batch over decode steps "
                 f"{steps - s['window']}-{steps} (context {first}-{first + s['window']}: for dense, cheaper than the "
                 f"rollout's mean context {s['prompt'] + s['search_new'] // 2}; for eviction, its steady state)",
                 ["cache", "largest batch", "tries (batch: fitted)", "peak GPU there", "KV per row (formula)",
                  "tokens/s at that batch", "vs dense", "of the bandwidth bound"])
    for sampler in ("full", LONG_POLICY):
        label = "ours full" if sampler == "full" else f"ours {sampler}, budget {budget}"
        r = attempt(record, report, f"table 4: {label}", [label],
                    lambda: measure_batch(model, s, sampler, steps, first + s["window"] / 2, bandwidth, weights),
                    settings=s)
        if r is None:
            continue
        record["batch"][sampler] = r
        speed, share = r["tokens_per_s"], r.get("bandwidth_share")
        batch = f"{r['found']}" + (" (the cap)" if r["found"] == s["search_cap"] else "")
        if r["batch"] != r["found"]:
            batch += f", timed at {r['batch']}"
        report.row([label, batch, ", ".join(f"{b}: {'yes' if ok else 'no'}" for b, ok in r["tries"]),
                    size(r["fit_peak_bytes"]),
                    size(kv_bytes(hf_config(s), rollout_kv_tokens(s, sampler, s["search_new"], budget))),
                    f"{speed:.0f}" if speed else "-", ratio(speed, record["batch"].get("full", {}).get("tokens_per_s")),
                    pct(share) if share else "-"])


def targets(s, report, record):
    """The targets (README "On one GPU"), measured in this run (ratios only; `-` where a row was skipped)."""
    rows, batch, shape = record["rows"], record["batch"], record["shape"]
    speed = lambda key: rows.get(key, {}).get("tokens_per_s")
    evicting = [speed(f"ours {name} any") for name in EVICTION]
    slowest = min(evicting) if all(evicting) else None
    dense_batch, evict_batch = batch.get("full", {}).get("batch"), batch.get(LONG_POLICY, {}).get("batch")
    found = [
        [f"our dense >= 1.0x HF generate, {'1.7B' if s['hidden'] == GPU['hidden'] else 'tiny'} shape, bf16 "
         f"({s['prompt']}+{s['new']}; {s['prompt']}+{s['long_new']})",
         "; ".join(ratio(speed(f"ours full {n}"), speed(f"{HF} {n}")) for n in ("new", "long_new"))],
        ["our dense >= 1.0x HF generate, bench.py's FULL shape, bf16", ratio(shape.get("full"), shape.get(HF))],
        [f"eviction (slowest of {len(EVICTION)}) >= dense at {s['prompt']}+{s['new']}", ratio(slowest, speed("ours full new"))],
        [f"eviction (slowest) > dense at {s['prompt']}+{s['long_new']}", ratio(slowest, speed("ours full long_new"))],
        [f"{LONG_POLICY} at budget {s['search_budget']} fits >= 2x dense's batch at {s['prompt']}+{s['search_new']}",
         f"{evict_batch} / {dense_batch} = {ratio(evict_batch, dense_batch)}" if dense_batch else "-"],
        ["... and turns it into more tokens/s", ratio(batch.get(LONG_POLICY, {}).get("tokens_per_s"),
                                                     batch.get("full", {}).get("tokens_per_s"))],
        [f"dense captured >= 4x HF generate at {s['prompt']}+{s['new']}",
         ratio(speed(f"{row_label('full', CAPTURED)} new"), speed(f"{HF} new"))],
        [f"snapkv captured >= 1.4x dense captured at {s['prompt']}+{s['new']}; >= 2x at {s['prompt']}+{s['long_new']}",
         "; ".join(ratio(speed(f"{row_label('snapkv', CAPTURED)} any"), speed(f"{row_label('full', CAPTURED)} {n}"))
                   for n in ("new", "long_new"))]]
    report.table("### Targets", ["target", "measured"], found)
    record["targets"] = dict(found)


def main(args):
    """The one-GPU bench (`bench.py --gpu`): tables 1-4 and the targets into args.out, a JSON record beside it."""
    s, device = dict(TINY if args.quick else GPU), torch.device("cuda" if torch.cuda.is_available() else "cpu")
    s["deadline"] = s["deadline"] if args.deadline is None else args.deadline
    started = time.perf_counter()
    s["stop_at"] = started + s["deadline"]   # the deadline as a moment, kept with the settings every table reads
    if device.type != "cuda" and not args.quick:
        raise SystemExit("bench.py --gpu: torch sees no GPU, and the 1.7B shape on a CPU takes hours (--quick: tiny)")
    out = Path(args.out or ("results/bench_gpu_quick.md" if args.quick else "results/bench_gpu.md"))   # quick: not the record
    report, record = Report(out), dict(settings=s, rows={}, shape={}, rescore={}, batch={}, errors={}, device=device)
    machine = f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}" if device.type == "cuda" else "CPU"
    machine += f", torch {torch.__version__}"
    log(f"measuring copy bandwidth on {device}")
    record["bandwidth"] = bandwidth = copy_bandwidth(s["copy_mib"] * 2**20 // 4, device)
    model = qwen3_model(s, device)
    # every parameter's bytes, a tied matrix once: what each decode step reads at least once
    record["weight_bytes"] = weights = sum(p.numel() * p.element_size() for p in model.parameters())
    report.write(f"Machine: {machine}. Model: random Qwen3, {s['layers']} layers, {s['hidden']} wide, {s['heads']} heads"
                 f" / {s['kv_heads']} KV heads of {hf_config(s)['head_dim']}, vocabulary {s['vocab']}, tied embeddings,"
                 f" bf16: {size(weights)} of weights. Copy bandwidth (device to device, read + write): "
                 f"{bandwidth / 1e9:.0f} GB/s. The bandwidth bound of a step: weights + the KV it reads, at that rate.")
    try:
        table_1(model, s, report, record, bandwidth, weights)
        table_2(s, report, record, device)
        table_3(model, s, report, record)
        table_4(model, s, report, record, bandwidth, weights)
    finally:   # a run cut short (an error, Ctrl-C, a time limit's SIGINT) still writes its targets and JSON
        targets(s, report, record)
        report.write(f"\nTotal wall time: {time.perf_counter() - started:.0f} s (and the imports before it).")
        for row in [*record["rows"].values(), *record["batch"].values()]:   # the token tensors stay out of the JSON
            row.pop("tokens", None)
        out.with_suffix(".json").write_text(json.dumps(record, indent=1, default=str))
    if record["errors"]:   # measured around them, but a failed row is a failed run: gpu_check.sh says so
        raise SystemExit(f"bench.py --gpu: {len(record['errors'])} row(s) failed (tracebacks above): "
                         + "; ".join(f"{k}: {v}" for k, v in record["errors"].items()))
    return record
