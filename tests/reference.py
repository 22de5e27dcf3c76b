"""Independent references the tests compare our code against.

- `tiny_model`: a small random Llama / Mistral / Qwen2 / Qwen3 with grouped-query attention.
- `masked_dense_logprobs`: one dense forward pass over prompt + response whose per-layer,
  per-KV-head attention mask hides exactly what the sparse cache had evicted at each step.
- `simulate_cache`: eviction for one prompt with Python loops, from explicit Q, K, V, written from
  docs/method.md's description of the authors' batch-1 code (not from kvcache.py).
- `caches_passed`: the caches a rollout passed to the model, for a test to read after it.
- `HostReads`: records the ops that read a device value on the host, what a CUDA graph cannot capture.
"""
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (AttentionInterface, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from kvcache import CACHE_ARG   # the forward's name for the cache (transformers 5.x renamed it)

ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
         "qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}


def tiny_model(arch="llama", seed=0, **overrides):
    """A random model: 2 layers, 4 query heads sharing 2 KV heads, vocabulary 64, fp32, eval mode."""
    config_cls, model_cls = ARCHS[arch]
    settings = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    settings.update(overrides)
    torch.manual_seed(seed)
    return model_cls(config_cls(**settings)).eval()


class HostReads(TorchDispatchMode):
    """Records every op under it that a CUDA graph cannot capture: a device value read on the host (`.item()`,
    `bool()`, `.tolist()`, `torch.equal`), an output shape that depends on data (`nonzero`,
    boolean indexing), or host data copied in (`torch.tensor([...])`; a Python number, as in `x[:2] = 0.0`,
    is a kernel argument and is allowed). On a GPU each one waits for the device, or fails inside a capture."""
    SYNCS = {"aten::_local_scalar_dense", "aten::equal", "aten::is_nonzero", "aten::nonzero", "aten::masked_select",
             "aten::repeat_interleave.Tensor", "aten::_unique2", "aten::unique_consecutive"}

    def __init__(self):
        super().__init__()
        self.seen, self.calls = [], 0

    def watch(self, fn):
        """`fn`, run under this mode at every call (counted in `calls`)."""
        def watched(*args, **kwargs):
            self.calls += 1
            with self:
                return fn(*args, **kwargs)
        return watched

    def __enter__(self):   # .tolist() reads the data without dispatching an op: watched by hand
        self.tolist = torch.Tensor.tolist
        torch.Tensor.tolist = lambda t: self.seen.append("tolist") or self.tolist(t)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self.tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if (name in self.SYNCS or name == "aten::lift_fresh" and args[0].dim() > 0
                or name == "aten::index.Tensor" and any(i is not None and i.dtype == torch.bool for i in args[1])):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def caches_passed(model):
    """A list that collects every cache the sampler passes to `model`'s forward: a test reads one after the
    rollout (generate keeps none)."""
    caches = []
    model.register_forward_pre_hook(lambda module, args, kwargs: caches.append(kwargs[CACHE_ARG]),
                                    with_kwargs=True)
    return caches


def hf_greedy(model, prompts, max_new_tokens, pad_token_id=0, eos_token_id=None):
    """Hugging Face `generate(do_sample=False)` on a left-padded batch -> new tokens [N, T]."""
    P = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_token_id] * (P - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                         min_new_tokens=0, pad_token_id=pad_token_id, eos_token_id=eos_token_id)
    return out[:, P:]


def full_forward_logprobs(model, prompt, response, temperature=1.0):
    """Log-probs of `response` after `prompt` from one plain forward pass (no cache, one row)."""
    ids = torch.tensor([prompt + response], device=model.device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1: -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, ids[0, len(prompt):, None])[:, 0]


def _masked_eager(module, query, key, value, attention_mask, scaling, dropout=0.0, layer_masks=None,
                  sliding_window=None, key_positions=None, **kwargs):
    """Plain eager attention with a per-layer mask [B, H_kv, L, L] (True = may attend).

    Mistral-style sliding windows (a query at p sees keys after p - window) apply on top."""
    group = query.shape[1] // key.shape[1]
    mask = layer_masks[module.layer_idx].repeat_interleave(group, dim=1)
    if sliding_window is not None:
        p = key_positions[:, None]
        mask = mask & ((p[..., None, :] > p[..., :, None] - sliding_window) | (p[..., :, None] < 0))
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    logits = (query @ key.transpose(-1, -2)).double() * scaling
    weights = logits.masked_fill(~mask, float("-inf")).softmax(-1).to(value.dtype)
    return (weights @ value).transpose(1, 2), None


AttentionInterface.register("masked_reference", _masked_eager)


def masked_dense_logprobs(model, rollouts, temperature=1.0):
    """Recompute a sparse rollout densely, hiding at each step exactly what the cache had evicted.

    Needs `rollouts.kept` (generate with record=True). Returns [N, T].
    Coordinates: the left-padded prompt occupies [0, P); response token t sits at P + t.
    Step 0 is the prefill (queries 0..P-1); step s >= 1 feeds response token s - 1.
    """
    history = [list(layer.cpu()) for layer in rollouts.kept]          # per layer, per step [N, H_kv, S]
    tokens = rollouts.tokens.cpu()
    N, T = tokens.shape
    P = max(len(p) for p in rollouts.prompts)
    L = P + T - 1                                                      # the last token is never fed
    lens = torch.tensor([len(p) for p in rollouts.prompts])
    coord = torch.arange(L)[None]
    pos = (coord - (P - lens[:, None])).masked_fill(coord < P - lens[:, None], -1)   # [N, L]
    ids = torch.cat([torch.tensor([[0] * (P - len(p)) + p for p in rollouts.prompts]), tokens[:, :-1]], 1)
    step_of_query = (coord - P + 1).clamp(min=0)[0]                    # [L]
    H_kv = history[0][0].shape[1]
    masks = []
    for layer in history:
        mask = torch.zeros(N, H_kv, L, L, dtype=torch.bool)
        for i in range(L):
            kept = layer[step_of_query[i]]                             # [N, H_kv, S] positions
            visible = (pos[:, None, :, None] == kept[:, :, None, :]).any(-1)   # [N, H_kv, L]
            mask[:, :, i] = visible & (pos[:, None, :] <= pos[:, None, i:i + 1]) & (pos[:, None, :] >= 0)
            mask[:, :, i] |= (pos[:, i] < 0)[:, None, None]           # padding queries: anything finite
        masks.append(mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation("masked_reference")
    device = model.device
    try:
        with torch.no_grad():
            logits = model(ids.to(device), position_ids=pos.clamp(min=0).to(device),
                           layer_masks=[m.to(device) for m in masks], key_positions=pos.to(device)).logits[:, P - 1:]
    finally:
        model.set_attn_implementation(previous)
    logp = torch.log_softmax(logits.float() / (temperature or 1.0), -1)
    return logp.gather(-1, rollouts.tokens[..., None])[..., 0] * rollouts.mask


# ----------------------------------------------------------------------------- loop-based eviction
# Written from docs/method.md section 2 ("How the authors' code scores"), one prompt at a time with no
# padding, as the authors' batch-1 code runs: nothing here is shared with kvcache.py.

def _softmax(xs):
    top = max(xs)
    e = [math.exp(x - top) for x in xs]
    return [x / sum(e) for x in e]


def _pool(values, kernel, how):
    """F.avg_pool1d / F.max_pool1d with padding kernel // 2: zeros counted in the mean; max over what exists."""
    out = []
    for i in range(len(values)):
        near = values[max(0, i - kernel // 2): i + kernel // 2 + 1]
        out.append(max(near) if how == "max" else sum(near) / kernel)
    return out


def _dot(a, b):
    return float(a.double() @ b.double())


def simulate_cache(sparse, q, k, v, prompt_len, scaling, sliding_window=None):
    """Eviction for ONE prompt, re-done with Python loops over heads and tokens from explicit tensors.

    q [H, L, D], k, v [H_kv, L, D]: token c sits at position c; the first `prompt_len` tokens are the
    prefill (kept whole), then one token per step. Returns, per step, the kept positions of each KV
    head (sorted lists), and the attention outputs [H, L, D] (float64). `sliding_window`: a query at c
    sees the keys after c - sliding_window only, and a compression first drops the keys no query sees again.
    """

    def sees(c, s):   # whether a query at position c may attend the key at position s
        return s <= c and (sliding_window is None or s > c - sliding_window)

    H, L, D = q.shape
    H_kv = k.shape[0]
    G = H // H_kv
    out = torch.zeros(H, L, D, dtype=torch.float64)
    kept = [[] for _ in range(H_kv)]
    received = [{} for _ in range(H_kv)]                                # H2O: attention each key received
    steps, slots = [], 0     # slots a row holds: its kept keys, and the holes of keys out of the window
    for step, new in enumerate([list(range(prompt_len))] + [[c] for c in range(prompt_len, L)]):
        slots += len(new)
        due = sparse.policy != "full" and step > 0 and slots > sparse.budget and slots - sparse.budget >= sparse.interval
        slots = sparse.budget if due else slots     # a compression keeps `budget` slots: holes where too few keys are left
        for h in range(H_kv):
            kept[h] = kept[h] + new
            received[h].update({c: 0.0 for c in new})
            if due:
                newest = kept[h][-1]
                kept[h] = [c for c in kept[h] if sees(newest, c)]               # out of the window: gone for good
                window = [c for c in kept[h] if c > newest - sparse.window]
                before = [c for c in kept[h] if c <= newest - sparse.window]
                score = _scores(sparse, q, k, h, G, kept[h], before, window, received[h], scaling, sees)
                best = sorted(range(len(before)), key=lambda i: -score[i])[: sparse.budget - len(window)]
                kept[h] = sorted([before[i] for i in best] + window)
            for g in range(G):                                           # this step's queries attend
                head = h * G + g
                for c in new:
                    seen = [s for s in kept[h] if sees(c, s)]
                    w = _softmax([_dot(q[head, c], k[h, s]) * scaling for s in seen])
                    out[head, c] = sum(wi * v[h, s].double() for wi, s in zip(w, seen))
                    for wi, s in zip(w, seen):
                        received[h][s] += wi / G                         # mean over the group's heads
        steps.append([list(kept[h]) for h in range(H_kv)])
    return steps, out


def _scores(sparse, q, k, h, G, kept, before, window, received, scaling, sees):
    """One KV head's score for each key in `before` (the kept keys before the observation window);
    `sees(c, s)`: whether a query at c may attend the key at s."""
    if sparse.policy == "streaming":
        return [math.inf if c < sparse.sink else float(c) for c in before]
    if sparse.policy == "h2o":
        return [received[c] for c in before]
    if sparse.policy == "snapkv":
        # softmax of each window query over the keys up to itself; the before-window keys' probabilities
        # summed over the window, mean over the group's query heads; average-pooled along `before`
        attention = {c: 0.0 for c in before}
        for g in range(G):
            for w in window:
                seen = [s for s in kept if sees(w, s)]
                for s, p in zip(seen, _softmax([_dot(q[h * G + g, w], k[h, s]) * scaling for s in seen])):
                    if s in attention:
                        attention[s] += p / G
        return _pool([attention[c] for c in before], sparse.kernel, "avg")
    # R-KV: the max over the group's logits, softmax over `before` only, mean over the window queries,
    # max-pooled; minus the redundancy among all kept keys
    importance = [0.0] * len(before)
    for w in window:
        logits = [max(_dot(q[h * G + g, w], k[h, s]) for g in range(G)) * scaling for s in before]
        importance = [a + p / len(window) for a, p in zip(importance, _softmax(logits))]
    importance = _pool(importance, sparse.kernel, "max")
    unit = [k[h, c].double() / (k[h, c].double().norm() + 1e-8) for c in kept]
    columns = [0.0] * len(kept)
    for i in range(len(kept)):
        row = [0.0 if i == j else float(unit[i] @ unit[j]) for j in range(len(kept))]
        above = [j for j in range(len(kept)) if row[j] > 0.5]
        row[max(above) if above else 0] = 0.0                           # the one duplicate a row keeps
        columns = [a + b for a, b in zip(columns, row)]
    redundancy = dict(zip(kept, _softmax([c / len(kept) for c in columns])))
    return [sparse.lam * a - (1 - sparse.lam) * redundancy[c] for a, c in zip(importance, before)]
