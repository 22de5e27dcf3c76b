"""The cost model: what one decode step computes and reads, for a Llama-style Hugging Face config (docs/method.md
section 6): grouped-query attention and a gated MLP, as Llama, Qwen3 and SmolLM2.

A decode step multiplies every weight once (2 FLOPs per parameter per row) and attends over each layer's kept
keys and values; on a GPU it is bound by the bytes it reads (the weights once, then every row's K and V), so
a budget that caps the kept tokens caps the step's cost. Kinetics prices a step as FLOPs + intensity x bytes,
intensity being what a byte of memory traffic is worth in FLOPs on the card (H100, bf16: ~295).

What is notable here:
- `shape` reads the head width as Hugging Face does: a config's own `head_dim` (Qwen3: 128) before
  hidden / heads; every KV-size formula in the repository goes through it, and `kv_bytes` (bench.py's
  memory check, bench_static.py's "does the cache fit") is section 2's `2 x layers x kv_heads x head_dim x tokens`.
- `cost` / `speedup`: section 6's per-step cost, and a schedule's predicted rollout speedup over dense;
  `speedup_table` is the table that `python schedule.py --speedup FILE.json` prints for Qwen3-1.7B/4B/8B.

    python -c "import cost; print(cost.speedup(cost.QWEN3['Qwen3-1.7B'], lambda c: 2048, 32768))"
"""
from cli import markdown
from hook import SUPPORTED_MODELS
from kvcache import DENSE, check_number
from policies import attended_pages

# Public config.json of Qwen/Qwen3-1.7B, Qwen/Qwen3-4B and Qwen/Qwen3-8B on the Hugging Face hub.
QWEN3 = {
    "Qwen3-1.7B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "Qwen3-4B": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "Qwen3-8B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
}
SPARROW_SPEEDUP = {"Qwen3-1.7B": 2.2, "Qwen3-4B": 2.4, "Qwen3-8B": 2.0}   # reported at threshold 0.86
H100_INTENSITY = 989e12 / 3.35e12   # bf16 dense FLOP/s per byte/s of HBM: ~295 FLOPs a byte is worth


def shape(config):
    """(layers, heads, kv_heads, head_dim, matmul parameters) of a Llama-style HF config or a dict of its fields
    (a model_type, if any, one of hook.SUPPORTED_MODELS: the families whose MLP is gated, 3 matrices)."""
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    needed = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    if missing := [k for k in needed if get(k) is None]:             # GPT-2's: n_inner, no intermediate_size
        raise ValueError(f"the cost model reads a Llama-style config (gated MLP); this one has no {', '.join(missing)}")
    if get("model_type") not in (None, *SUPPORTED_MODELS):          # Phi, GPT-NeoX: the fields, two MLP matrices
        raise ValueError(f"the cost model prices a gated MLP, as model_type {', '.join(SUPPORTED_MODELS[:-1])} and "
                         f"{SUPPORTED_MODELS[-1]} have; got model_type {get('model_type')!r}")
    h, L, n, n_kv = get("hidden_size"), get("num_hidden_layers"), get("num_attention_heads"), get("num_key_value_heads")
    n_kv, d = n_kv or n, get("head_dim") or h // n
    # q and o: h * n * d each; k and v: h * n_kv * d each; gated MLP: 3 * h * intermediate; lm head: V * h
    params = L * (2 * h * n * d + 2 * h * n_kv * d + 3 * h * get("intermediate_size")) + get("vocab_size") * h
    return L, n, n_kv, d, params


def kv_bytes(config, tokens, batch=1, bytes_per=2):
    """Bytes of the keys and values that `tokens` positions of each of `batch` rows take in every layer (section 2):
    2 (K and V) x layers x kv_heads x head_dim x tokens x batch x bytes_per."""
    L, _, n_kv, d, _ = shape(config)
    return 2 * L * n_kv * d * tokens * batch * bytes_per


def cost(config, context, budget=None, batch=1, page_size=None, dense_layers=0, bytes_per=2, intensity=H100_INTENSITY):
    """One decode step's cost for `batch` rows at `context` tokens (section 6, after Kinetics).

    A sparse layer reads kv_len = min(context, budget) tokens (page_size given: blocktopk, which attends budget //
    page_size pages plus the first and 2 newest, and scores context / page_size mean keys per KV head first);
    the first `dense_layers` and a budget of None (a dense model) read everything; so does a budget >= context,
    blocktopk's still scoring every page (as KVCache does at any budget, a schedule's dense DENSE too). An
    evicting cache holds budget .. budget + interval - 1 tokens between compressions: pricing the budget makes
    its speedup optimistic by (interval - 1) / 2 tokens a layer (12 % more KV read at 512 / 128).
    Returns dict(flops, bytes, cost) with cost = flops + intensity * bytes (effective FLOPs).
    """
    for name, value, least in (("context", context, 1), ("batch", batch, 1), ("dense_layers", dense_layers, 0)):
        check_number(name, value, least, DENSE)       # dense_layers -1 priced L + 1 sparse layers, below the weights
    if page_size is not None:
        check_number("page_size", page_size, 1, DENSE)   # 0 read as no page_size: an eviction policy's price
    if budget is not None:
        check_number("budget", budget, 1, DENSE)         # < 1: a negative kv_len, priced below the weights alone
    if dense_layers and not page_size:                   # as KVCache: only block top-k keeps layers dense
        raise ValueError(f"dense_layers={dense_layers} is block top-k's (give its page_size); an evicting cache "
                         "compresses every layer")
    L, n, n_kv, d, P = shape(config)
    sparse = 0 if budget is None else L - min(dense_layers, L)   # the sparse cache's layers (blocktopk: paged)
    kv = context
    if sparse:   # eviction: the budget; blocktopk: the budget's pages and the reserved ones
        kv = min(context, attended_pages(budget, page_size) * page_size if page_size else budget)
    read = (L - sparse) * context + sparse * kv                       # kv_len summed over the layers
    flops = batch * (2 * P + 4 * n * d * read)                        # per row: 2 * P for the weights, QK and PV
    data = bytes_per * (P + batch * 2 * n_kv * d * read)              # the weights once a step, each row's K and V
    if page_size and sparse:
        pages = -(-context // page_size)
        flops += batch * sparse * 2 * n_kv * d * pages                # group-mean query . mean key
        # the mean keys are read, priced at `bytes_per` like the keys; our KVCache keeps them as fp32 page sums,
        # twice these bytes in bf16 (bench_gpu.kv_read_bytes counts ours)
        data += bytes_per * batch * sparse * n_kv * d * pages
    return dict(flops=flops, bytes=data, cost=flops + intensity * data)


def speedup(config, schedule, context, prompt=0, stride=64, **kwargs):
    """Predicted rollout speedup over dense: summed dense cost / summed sparse cost of the decode
    steps from `prompt` to `context` tokens (every `stride`-th step), the budget from `schedule`
    (any callable `context length -> budget or None`, as `schedule.Schedule`)."""
    check_number("stride", stride, 1, DENSE)                  # 0: range()'s error; < 0: no step, blamed on context
    check_number("prompt", prompt, 0, DENSE)                  # < 0: steps at contexts <= 0, a negative kv_len
    steps = range(prompt + 1, context + 1, stride)
    if not steps:
        raise ValueError(f"no decode step from prompt {prompt} to context {context}: context must exceed prompt")
    total = lambda budget: sum(cost(config, c, budget(c), **kwargs)["cost"] for c in steps)
    return total(lambda c: None) / total(schedule)           # None: a dense model, no cache (no page scored)


def speedup_table(schedules, context, batch, policy, **pages):
    """The markdown table of each (label, schedule)'s predicted speedup at `context` tokens, batch `batch`, for the
    Qwen3 shapes, with Sparrow's reported speedups last (`pages`: blocktopk's page_size and dense_layers)."""
    rows = [[label, *(f"{speedup(c, x, context, batch=batch, **pages):.2f}x" for c in QWEN3.values())]
            for label, x in schedules]
    rows.append(["Sparrow reported (block top-k, threshold 0.86)", *(f"{SPARROW_SPEEDUP[n]}x" for n in QWEN3)])
    return (f"Predicted rollout speedup over dense ({policy}, {context} tokens decoded at batch {batch}; cost model "
            f"of docs/method.md section 6 with H100 bf16 balance)\n\n" + markdown(["schedule", *QWEN3], rows))
