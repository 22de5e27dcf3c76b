"""Independent references the tests compare our code against.

- `tiny_model`: a small random Llama / Mistral / Qwen2 / Qwen3 with grouped-query attention.
- `masked_dense_logprobs`: one dense forward pass over prompt + response whose per-layer,
  per-KV-head attention mask hides exactly what the sparse cache had evicted at each step.
- `simulate_cache`: a slow, loop-based re-implementation of eviction from explicit Q, K, V.
"""
import math

import torch
from transformers import (AttentionInterface, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

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


def hf_greedy(model, prompts, max_new_tokens, pad_token_id=0, eos_token_id=None):
    """Hugging Face `generate(do_sample=False)` on a left-padded batch -> new tokens [N, T]."""
    P = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_token_id] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                         min_new_tokens=0, pad_token_id=pad_token_id, eos_token_id=eos_token_id)
    return out[:, P:]


def full_forward_logprobs(model, prompt, response, temperature=1.0):
    """Log-probs of `response` after `prompt` from one plain forward pass (no cache, one row)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1: -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


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

    Needs `rollouts.stats["cache"].history` (generate with record=True). Returns [N, T].
    Coordinates: the left-padded prompt occupies [0, P); response token t sits at P + t.
    Step 0 is the prefill (queries 0..P-1); step s >= 1 feeds response token s - 1.
    """
    history = rollouts.stats["cache"].history
    N, T = rollouts.tokens.shape
    P = max(len(p) for p in rollouts.prompts)
    L = P + T - 1                                                      # the last token is never fed
    lens = torch.tensor([len(p) for p in rollouts.prompts])
    coord = torch.arange(L)[None]
    pos = (coord - (P - lens[:, None])).masked_fill(coord < P - lens[:, None], -1)   # [N, L]
    ids = torch.cat([torch.tensor([[0] * (P - len(p)) + p for p in rollouts.prompts]), rollouts.tokens[:, :-1]], 1)
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
    try:
        with torch.no_grad():
            logits = model(ids, position_ids=pos.clamp(min=0), layer_masks=masks,
                           key_positions=pos).logits[:, P - 1:].float()
    finally:
        model.set_attn_implementation(previous)
    logp = torch.log_softmax(logits / (temperature or 1.0), -1)
    return logp.gather(-1, rollouts.tokens[..., None])[..., 0] * rollouts.mask


# ----------------------------------------------------------------------------- loop-based eviction

def _softmax(xs):
    top = max(xs)
    e = [math.exp(x - top) for x in xs]
    return [x / sum(e) for x in e]


def _pool(values, kernel, how):
    out = []
    for i in range(len(values)):
        near = values[max(0, i - kernel // 2): i + kernel // 2 + 1]
        out.append(max(near) if how == "max" else sum(near) / len(near))
    return out


def simulate_cache(sparse, q, k, v, pos, prompt_len, scaling):
    """Eviction re-done with Python loops over rows, heads and tokens, from explicit tensors.

    q [B, H, L, D], k, v [B, H_kv, L, D], pos [B, L] (-1 = padding); the first `prompt_len`
    coordinates are the prefill, then one token per step. Returns, per step, the kept
    positions per (row, KV head) as sorted lists, and the attention outputs [B, H, L, D].
    """
    B, H, L, D = q.shape
    H_kv = k.shape[1]
    G = H // H_kv
    out = torch.zeros(B, H, L, D, dtype=torch.float64)
    kept = [[[] for _ in range(H_kv)] for _ in range(B)]              # coordinates, in slot order
    acc = [[{} for _ in range(H_kv)] for _ in range(B)]
    steps = []
    for step, new in enumerate([list(range(prompt_len))] + [[c] for c in range(prompt_len, L)]):
        window_coords = [c for c in range(new[-1] + 1)][-sparse.window:]
        for b in range(B):
            real = sum(1 for c in kept[b][0] + new if pos[b, c] >= 0)    # each row counts its own tokens
            due = sparse.policy != "full" and step > 0 and real - sparse.budget >= max(1, sparse.interval)
            for h in range(H_kv):
                slots = kept[b][h] + new
                for c in new:
                    acc[b][h][c] = 0.0
                if due:
                    score = _scores(sparse, q, k, pos, b, h, G, slots, window_coords, acc[b][h], scaling)
                    newest = max(pos[b, c].item() for c in slots)
                    score = [math.inf if pos[b, c] > newest - sparse.window else s for c, s in zip(slots, score)]
                    score = [-math.inf if pos[b, c] < 0 else s for c, s in zip(slots, score)]
                    best = sorted(range(len(slots)), key=lambda i: -score[i])[: sparse.budget]
                    slots = [slots[i] for i in sorted(best)]
                kept[b][h] = slots
                for g in range(G):                                     # attention of this step's queries
                    head = h * G + g
                    for c in new:
                        if pos[b, c] < 0:
                            continue
                        seen = [s for s in slots if 0 <= pos[b, s] <= pos[b, c]]
                        w = _softmax([(q[b, head, c].double() @ k[b, h, s].double()).item() * scaling for s in seen])
                        out[b, head, c] = sum(wi * v[b, h, s].double() for wi, s in zip(w, seen))
                        for wi, s in zip(w, seen):
                            acc[b][h][s] += wi / G
        steps.append([[sorted(pos[b, c].item() for c in kept[b][h] if pos[b, c] >= 0) for h in range(H_kv)]
                      for b in range(B)])
    return steps, out


def _scores(sparse, q, k, pos, b, h, G, slots, window_coords, acc, scaling):
    """One (row, KV head)'s score for every slot, as the policies of METHOD.md section 2 define it."""
    if sparse.policy == "streaming":
        return [math.inf if pos[b, c] < sparse.sink else float(pos[b, c]) for c in slots]
    if sparse.policy == "h2o":
        return [acc[c] for c in slots]
    importance = [0.0] * len(slots)
    for g in range(G):
        for w in window_coords:
            if pos[b, w] < 0:
                continue
            seen = [i for i, c in enumerate(slots) if 0 <= pos[b, c] <= pos[b, w]]
            probs = _softmax([(q[b, h * G + g, w].double() @ k[b, h, slots[i]].double()).item() * scaling
                              for i in seen])
            for i, p in zip(seen, probs):
                importance[i] += p / G
    if sparse.policy == "snapkv":
        return _pool(importance, sparse.kernel, "avg")
    importance = _pool(importance, sparse.kernel, "max")
    valid = [i for i, c in enumerate(slots) if pos[b, c] >= 0]
    unit = [k[b, h, c].double() / k[b, h, c].double().norm() for c in slots]
    mean_sim = []
    for i in range(len(slots)):
        sims = [(unit[i] @ unit[j]).item() for j in valid if j != i]
        mean_sim.append(sum(s for s in sims if s > 0.5) / len(valid))
    red = _softmax([mean_sim[i] for i in valid])
    redundancy = [0.0] * len(slots)
    for i, r in zip(valid, red):
        redundancy[i] = r
    return [sparse.lam * a - (1 - sparse.lam) * r for a, r in zip(importance, redundancy)]
