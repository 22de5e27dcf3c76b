"""The attention hook: a model's attention, computed over the slots a `kvcache.KVCache` keeps (docs/method.md section 2).

transformers lets a model's attention layers call a registered function in place of their own attention
(`AttentionInterface`, its public interface); nothing of the model's code is copied, so any Llama, Mistral, Qwen2 or
Qwen3 model runs through it unchanged. `sparse_attention(model)` routes the layers to `sparse_attention_forward` for a
block; that function hands each layer's query to the cache (`KVCache.attend`: compress if due), which calls
`attention` over the kept keys and values.

What is notable here:
- The mask is built from positions alone (`visible`): a kept key keeps the absolute position it was computed at, so
  one rule, `key_pos <= query_pos`, serves the prefill and left padding alike, whatever the cache evicted.
- A decode step treats the query heads of a KV head as rows of one query: each kept key is read once per group,
  and a step over real earlier tokens needs no mask at all.
- H2O needs the attention each key received, so for it the softmax is computed explicitly, in fp32.

    with sparse_attention(model):
        cache.start_step(positions)
        model(ids, position_ids=positions.clamp(min=0), **{kvcache.CACHE_ARG: cache}, kv_cache=cache)
"""
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface

from policies import CHUNK

SUPPORTED_MODELS = ("llama", "mistral", "qwen2", "qwen3")
# cuDNN's SDPA builds a new execution plan for every new key length, and a dense cache grows by one
# key per step: in bf16 on an H100 that cost ~8 ms of CPU per call (our decode at 0.13x Hugging Face).
# The other backends take any length, so they are the only ones our hook lets SDPA choose.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def visible(key_pos, query_pos, sliding_window=None):
    """Which keys each query may see, from positions alone: key_pos [B, h, S], query_pos [B, q] -> [B, h, q, S].

    A query at p sees the valid keys at positions <= p (and > p - sliding_window for Mistral-style
    models). A padding query (position -1) sees every slot, so its unused output stays finite.
    """
    kp, qp = key_pos[:, :, None, :], query_pos[:, None, :, None]
    allowed = (kp >= 0) & (kp <= qp)
    if sliding_window is not None:
        allowed &= kp > qp - sliding_window
    return allowed | (qp < 0)


def attention(query, keys, values, key_pos, query_pos, scaling, sliding_window=None, masked=True, weights=False):
    """Attend queries [B, H, q, D] over kept slots [B, H_kv, S, D]; -> (out [B, H, q, D], received or None).

    A decode step (q = 1) treats the G = H / H_kv query heads of a KV head as G query rows of
    that head: each kept key is read once per group, nothing is copied, and the mask, one row per
    KV head [B, H_kv, 1, S], broadcasts over the G rows; it is the valid slots alone (`key_pos >= 0`),
    as a step holds no key after its query, unless a sliding window also hides old ones. The prefill
    (q > 1, nothing evicted yet, so every KV head holds the same positions) repeats the keys per query head, as Hugging Face's
    SDPA path does, under one [B, 1, q, S] mask. `masked=False`: the caller knows every slot is
    visible (a decode step over real tokens). `weights=True` (H2O) computes the softmax explicitly,
    CHUNK queries at a time, and also returns `received` [B, H, S]: the attention each slot got
    from this step's real queries.
    """
    B, H, q, D = query.shape
    G = H // keys.shape[1]
    if q == 1:
        rows, mask = query.reshape(B, -1, G, D), None
        if masked:   # every key a decode step holds came before its query or with it: the valid ones are visible
            mask = key_pos[:, :, None] >= 0 if sliding_window is None else visible(key_pos, query_pos, sliding_window)
    else:
        rows, keys, values = query, keys.repeat_interleave(G, 1), values.repeat_interleave(G, 1)
        mask = visible(key_pos[:, :1], query_pos, sliding_window)
    if not weights:   # reshape: CUDA's memory-efficient kernel returns [B, H_kv, G, D] with G and H_kv not adjacent
        return F.scaled_dot_product_attention(rows, keys, values, attn_mask=mask, scale=scaling).reshape(B, H, q, D), None
    outs, received = [], 0.0
    with torch.autocast(query.device.type, enabled=False):   # H2O's weights in fp32, under bf16 autocast too
        for start in range(0, rows.shape[2], CHUNK):
            part = slice(start, start + CHUNK)
            logits = rows[:, :, part].float() @ keys.float().transpose(-1, -2) * scaling    # upcast first
            if mask is not None:
                logits = logits.masked_fill(~(mask if q == 1 else mask[:, :, part]), float("-inf"))
            w = logits.softmax(-1)
            outs.append(w.to(values.dtype) @ values)
            if q == 1:    # the G rows of a KV head are its G query heads (G <= CHUNK: one chunk)
                received = w.reshape(B, H, -1)
            else:         # padding queries (position -1) give nothing
                received = received + (w * (query_pos[:, part] >= 0)[:, None, :, None]).sum(2)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, 2)    # a decode step is one chunk: no copy
    return out.reshape(B, H, q, D), received    # reshape: a matmul's output need not be contiguous on every device


# ----------------------------------------------------------------------------- the hook

def sparse_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                             kv_cache=None, sliding_window=None, **kwargs):
    """transformers attention function "sparse_kv": attention over the `kv_cache`'s kept slots.

    transformers calls it from inside each attention layer after rotary embeddings and
    `kv_cache.update`; `key`, `value` and the (absent) `attention_mask` are ignored because
    the cache knows which slots are kept and where they sit.
    """
    if kv_cache is None:
        raise ValueError("the sparse_kv attention needs the cache: call model(..., kv_cache=cache)")
    out = kv_cache.attend(module.layer_idx, query, scaling, sliding_window)
    return out.transpose(1, 2), None


AttentionInterface.register("sparse_kv", sparse_attention_forward)


@contextmanager
def sparse_attention(model):
    """Route the model's attention through `sparse_attention_forward` (SDPA without cuDNN) for a block; a clear
    error for architectures whose attention we have not verified."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED_MODELS:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODELS)}")
    previous = model.config._attn_implementation
    model.set_attn_implementation("sparse_kv")
    try:
        with sdpa_kernel(SDPA_BACKENDS):
            yield model
    finally:
        model.set_attn_implementation(previous)
