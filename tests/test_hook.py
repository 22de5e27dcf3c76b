"""The attention hook (hook.py): attention over kept slots against a loop of explicit softmaxes, the layouts SDPA
may return, and the architectures it refuses."""
import contextlib

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import hook
from hook import attention, sparse_attention
from kvcache import CACHE_ARG, KVCache, SparseConfig
from reference import tiny_model
from sampler import generate


def loop_attention(query, keys, values, key_pos, query_pos, scaling, sliding_window=None):
    """The reference: for every row, query head and query, a softmax over the keys it may see, one at a time in
    float64 (a padding query, position -1, sees every slot). -> out [B, H, q, D], weights [B, H, q, S]."""
    B, H, q, D = query.shape
    G, S = H // keys.shape[1], keys.shape[2]
    out, weights = torch.zeros(B, H, q, D, dtype=torch.float64), torch.zeros(B, H, q, S, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(q):
                p = query_pos[b, i].item()
                seen = [s for s in range(S) if p < 0 or (0 <= key_pos[b, h // G, s] <= p and (
                        sliding_window is None or key_pos[b, h // G, s] > p - sliding_window))]
                logits = torch.stack([query[b, h, i].double() @ keys[b, h // G, s].double() * scaling for s in seen])
                w = logits.softmax(0)
                weights[b, h, i, seen] = w
                out[b, h, i] = (w[:, None] * values[b, h // G, seen].double()).sum(0)
    return out, weights


def random_qkv(q, S, seed=0, B=2, H=4, H_kv=2, D=8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, q, D, generator=g), torch.randn(B, H_kv, S, D, generator=g),
            torch.randn(B, H_kv, S, D, generator=g))


@pytest.mark.parametrize("sliding_window", [None, 3])
@pytest.mark.parametrize("weights", [False, True], ids=["sdpa", "explicit"])
def test_a_decode_step_over_kept_slots_with_holes_matches_a_loop_of_softmaxes(weights, sliding_window):
    # each KV head keeps its own positions, with holes (-1) where a compression left fewer than its neighbour
    query, keys, values = random_qkv(1, 6)
    key_pos = torch.tensor([[[0, 2, 5, -1, 7, 9], [1, -1, 4, 6, 8, 9]],
                            [[0, 1, 2, 3, 4, 5], [-1, -1, 0, 3, 4, 5]]])
    query_pos = torch.tensor([[9], [5]])
    out, received = attention(query, keys, values, key_pos, query_pos, 0.35, sliding_window, weights=weights)
    ref, w = loop_attention(query, keys, values, key_pos, query_pos, 0.35, sliding_window)
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=1e-5)
    if weights:   # H2O: the attention each slot received from the step's query heads
        torch.testing.assert_close(received.double(), w[:, :, 0], atol=1e-6, rtol=1e-5)
    else:
        assert received is None


@pytest.mark.parametrize("weights", [False, True], ids=["sdpa", "explicit"])
def test_a_left_padded_prefill_matches_a_loop_of_softmaxes(weights, monkeypatch):
    # row 0 is padded by 2: its padding queries see every slot (a finite, unused output) and give no attention;
    # CHUNK 2 makes the explicit path run its queries in 3 chunks
    monkeypatch.setattr(hook, "CHUNK", 2)
    query, keys, values = random_qkv(5, 5, seed=1)
    key_pos = torch.tensor([[-1, -1, 0, 1, 2], [0, 1, 2, 3, 4]])[:, None].expand(-1, 2, -1)
    out, received = attention(query, keys, values, key_pos, key_pos[:, 0], 0.35, weights=weights)
    ref, w = loop_attention(query, keys, values, key_pos, key_pos[:, 0], 0.35)
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=1e-5)
    if weights:
        real = (key_pos[:, 0] >= 0).double()[:, None, :, None]                     # [B, 1, q, 1]
        torch.testing.assert_close(received.double(), (w * real).sum(2), atol=1e-6, rtol=1e-5)


def test_unsupported_architecture_is_named():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    with pytest.raises(ValueError, match="'gpt2' is not supported; supported: llama, mistral, qwen2, qwen3"):
        with sparse_attention(gpt2):
            pass


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "static"])
def test_attention_takes_sdpa_output_in_the_efficient_kernels_layout(monkeypatch, captured):
    # On CUDA, SDPA's memory-efficient kernel (every masked decode step, every fp32 one) returns the decode
    # rows [B, H_kv, G, D] with H_kv and G not adjacent in memory: same values, strides a view cannot merge
    sdpa = hook.F.scaled_dot_product_attention

    def efficient_layout(*args, **kwargs):
        out = sdpa(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)
    model, prompts = tiny_model("llama"), [[5, 9, 3, 7], [4, 17]]                 # ragged: a masked decode
    sparse = SparseConfig("snapkv", budget=8, interval=3, window=2, sink=2, kernel=3)
    expected = generate(model, prompts, sparse, max_new_tokens=12, temperature=0, captured=captured)
    monkeypatch.setattr(hook.F, "scaled_dot_product_attention", efficient_layout)
    out = generate(model, prompts, sparse, max_new_tokens=12, temperature=0, captured=captured)
    assert torch.equal(out.tokens, expected.tokens) and torch.equal(out.logprobs, expected.logprobs)


def test_a_left_padded_prefill_under_a_sliding_window_matches_a_loop_of_softmaxes():
    # Pins the prefill's sliding window (Mistral-style): a query at p sees only keys > p - 2, even in the prefill.
    # The prefill above has no window, so a prefill mask that dropped `sliding_window` passed every test
    query, keys, values = random_qkv(5, 5, seed=2)
    key_pos = torch.tensor([[-1, -1, 0, 1, 2], [0, 1, 2, 3, 4]])[:, None].expand(-1, 2, -1)
    for weights in (False, True):
        out, _ = attention(query, keys, values, key_pos, key_pos[:, 0], 0.35, sliding_window=2, weights=weights)
        ref, _ = loop_attention(query, keys, values, key_pos, key_pos[:, 0], 0.35, sliding_window=2)
        torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("q", [1, 5], ids=["decode", "prefill"])
def test_h2o_weights_are_fp32_from_bf16_inputs_and_under_bf16_autocast(q):
    # Pins "H2O's weights in fp32" (the `.float()` upcast and the autocast switched off): from bf16 queries and keys,
    # and from fp32 ones under CPU bf16 autocast, `received` must match a float64 loop over the same values to fp32
    # precision. Logits in bf16 (~3 significant digits) move the weights by ~1e-2; the output keeps the values' dtype.
    query, keys, values = random_qkv(q, 5, seed=3)
    key_pos = torch.tensor([[0, 1, 2, 3, 4], [-1, 0, 1, 2, 3]])[:, None].expand(-1, 2, -1)
    query_pos = torch.tensor([[4], [3]]) if q == 1 else key_pos[:, 0]
    bf = [t.bfloat16() for t in (query, keys, values)]
    ref, w = loop_attention(*bf, key_pos, query_pos, 0.35)
    expected = w[:, :, 0] if q == 1 else (w * (query_pos >= 0).double()[:, None, :, None]).sum(2)
    out, received = attention(*bf, key_pos, query_pos, 0.35, weights=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(received.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)               # bf16 output: its rounding
    ref, w = loop_attention(query, keys, values, key_pos, query_pos, 0.35)
    expected = w[:, :, 0] if q == 1 else (w * (query_pos >= 0).double()[:, None, :, None]).sum(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, received = attention(query, keys, values, key_pos, query_pos, 0.35, weights=True)
    torch.testing.assert_close(received.double(), expected, atol=1e-5, rtol=1e-5)


def test_the_hook_on_a_full_cache_is_the_models_own_attention_under_a_sliding_window():
    # Pins what `sparse_attention_forward` hands the cache and gives back: the layer's scaling, its sliding_window
    # (Mistral's, 3 here, shorter than the 7-token prompt) and the output transposed to [B, q, H, D]. attention()'s
    # tests call it directly, so a hook that dropped the window, used scale 1 or reshaped instead of transposing
    # passed them. Reference: the plain Hugging Face forward (eager attention) over the whole sequence, a dense cache.
    model = tiny_model("mistral", sliding_window=3)
    model.set_attn_implementation("eager")
    ids = torch.tensor([[5, 9, 3, 7, 11, 2, 8, 13, 4, 6]])
    with torch.no_grad():
        expected = model(ids).logits
        cache = KVCache(SparseConfig("full"), model.config.num_hidden_layers, max_new_tokens=3)
        rows, start = [], 0
        with sparse_attention(model):
            for chunk in (ids[:, :7], ids[:, 7:8], ids[:, 8:9], ids[:, 9:]):     # a prefill, then 3 decode steps
                pos = torch.arange(start, start + chunk.shape[1])[None]
                cache.start_step(pos)
                rows.append(model(chunk, position_ids=pos, **{CACHE_ARG: cache}, kv_cache=cache).logits)
                start += chunk.shape[1]
    torch.testing.assert_close(torch.cat(rows, 1), expected, atol=1e-5, rtol=1e-5)


def test_sparse_attention_gives_the_model_its_own_attention_back():
    # Pins the `finally`: after the block, and after an error inside it, the model runs its previous attention again
    # (a model left on "sparse_kv" fails every later plain call: "the sparse_kv attention needs the cache")
    model = tiny_model("llama")
    model.set_attn_implementation("eager")
    for fail in (False, True):
        with pytest.raises(RuntimeError, match="inside") if fail else contextlib.nullcontext():
            with sparse_attention(model):
                assert model.config._attn_implementation == "sparse_kv"
                if fail:
                    raise RuntimeError("inside")
        assert model.config._attn_implementation == "eager"
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]]))


def test_sparse_attention_lets_sdpa_choose_every_backend_but_cudnn():
    # Pins SDPA_BACKENDS and the `sdpa_kernel` block (cuDNN re-plans for every new key length: ~8 ms of CPU a
    # decode step on an H100). torch keeps the choice in global flags, readable on a CPU too: inside the block
    # cuDNN is off and flash, memory-efficient and math are on; after it, cuDNN is back as it was
    cuda = torch.backends.cuda
    before = cuda.cudnn_sdp_enabled()
    with sparse_attention(tiny_model("llama")):
        enabled = (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(),
                   cuda.math_sdp_enabled())
    assert enabled == (False, True, True, True)
    assert cuda.cudnn_sdp_enabled() == before


def test_the_hook_without_a_cache_is_a_clear_error():
    # A forward inside the block that forgets kv_cache=cache is told what to pass (without the check: an
    # AttributeError on None deep inside the layer, naming nothing)
    model = tiny_model("llama")
    with sparse_attention(model), torch.no_grad():
        with pytest.raises(ValueError, match=r"needs the cache: call model\(\.\.\., kv_cache=cache\)"):
            model(torch.tensor([[1, 2, 3]]))
