"""cost.py: the cost model of one decode step (docs/method.md section 6) and the KV bytes (section 2).

Each test compares with an independent computation: a hand calculation, a brute-force sum, published parameter
counts, or the bytes a real Hugging Face cache holds."""
import pytest
import torch
from transformers import DynamicCache

import cost as cost_module
from cost import QWEN3, cost, kv_bytes, shape, speedup
from kvcache import CACHE_ARG, DENSE
from reference import tiny_model
from schedule import constant, piecewise

CONFIG = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=4, vocab_size=10)


def test_cost_matches_a_hand_computation():
    # P = 2 layers * (q, o: 2 * 8 * 2 * 4 + k, v: 2 * 8 * 1 * 4 + MLP 3 * 8 * 16) + lm head 10 * 8 = 1232
    c = cost(CONFIG, context=100, budget=20, batch=3, bytes_per=2, intensity=10)
    assert c["flops"] == 3 * (2 * 1232 + 2 * 4 * 2 * 4 * 20)            # 11232
    assert c["bytes"] == 2 * (1232 + 3 * 2 * (2 * 1 * 4 * 20))          # 4384
    assert c["cost"] == 11232 + 10 * 4384
    # blocktopk, pages of 4, first layer dense: layer 0 reads 100, layer 1 reads 20 + 3 pages = 32,
    # and scores 25 mean keys: 2 * kv_heads * head_dim FLOPs and kv_heads * head_dim values each
    b = cost(CONFIG, context=100, budget=20, batch=3, page_size=4, dense_layers=1, bytes_per=2, intensity=10)
    assert b["flops"] == 3 * (2 * 1232 + 4 * 2 * 4 * (100 + 32)) + 3 * 2 * 4 * 25
    assert b["bytes"] == 2 * (1232 + 3 * 2 * 4 * (100 + 32)) + 2 * 3 * 4 * 25
    # 102 tokens fill 26 pages, the last one partly, all 26 scored
    c = cost(CONFIG, context=102, budget=20, page_size=4, bytes_per=2, intensity=10)
    assert c["flops"] == 2 * 1232 + 2 * 4 * 2 * 4 * 32 + 2 * 2 * 1 * 4 * 26
    # a budget between whole pages attends its whole pages only (22 // 4 = 5, as KVCache.start_step): 32 tokens
    assert cost(CONFIG, 100, budget=22, page_size=4) == cost(CONFIG, 100, budget=20, page_size=4)
    # at 30 tokens the budget's 5 pages + 3 reserved would be 32 tokens: a layer reads only the 30 there are,
    # and scores ceil(30 / 4) = 8 mean keys
    c = cost(CONFIG, context=30, budget=20, page_size=4, bytes_per=2, intensity=10)
    assert c["flops"] == 2 * 1232 + 4 * 2 * 4 * (30 + 30) + 2 * 2 * 1 * 4 * 8    # 4512


def test_cost_of_more_dense_layers_than_layers_and_the_bytes_of_two_paged_layers():
    # Pins cost's `sparse` count: dense_layers past L leaves every layer dense (L - dense_layers < 0 would count
    # minus three sparse layers), and the mean keys' bytes are read by each sparse layer (not once per step).
    assert cost(CONFIG, 100, budget=20, page_size=4, dense_layers=5) == cost(CONFIG, 100, None)
    # 102 tokens, both layers paged: each reads (5 + 3) pages of 4 = 32 tokens and 26 mean keys (kv_heads 1, dim 4)
    c = cost(CONFIG, context=102, budget=20, page_size=4, bytes_per=2, intensity=10)
    assert c["bytes"] == 2 * (1232 + 2 * 1 * 4 * (32 + 32)) + 2 * 2 * 1 * 4 * 26   # 3904


def test_shape_counts_the_matmul_parameters_of_qwen3_and_fills_missing_fields():
    # keras-hub's presets give Qwen3-1.7B 1,720,574,976 parameters and Qwen3-4B 4,022,468,096 (tied embeddings: the
    # lm head is the embedding). Less the RMSNorm weights (per layer two of hidden size and the q and k norms of
    # head_dim, plus a final one), the rest are matmul weights. Qwen3-4B's head_dim, 128, is not hidden / heads = 80.
    for name, total in (("Qwen3-1.7B", 1_720_574_976), ("Qwen3-4B", 4_022_468_096)):
        c = QWEN3[name]
        norms = c["num_hidden_layers"] * (2 * c["hidden_size"] + 2 * c["head_dim"]) + c["hidden_size"]
        assert shape(c) == (c["num_hidden_layers"], c["num_attention_heads"], 8, 128, total - norms)
    # no kv-head count: multi-head attention; no head_dim: hidden / heads; q, k, v, o: 4 * 8 * 2 * 4, MLP 3 * 8 * 16
    assert shape(dict(CONFIG, num_key_value_heads=None, head_dim=None)) == (2, 2, 2, 4, 2 * (256 + 384) + 80)


def test_speedup_of_a_full_budget_is_one_and_a_small_budget_saves():
    assert speedup(CONFIG, constant(10 ** 6), 4096, batch=8) == 1.0
    assert speedup(CONFIG, piecewise([0], [None]), 4096, batch=8) == 1.0
    brute = sum(cost(CONFIG, c, None, batch=8)["cost"] for c in range(1, 4097)) / \
        sum(cost(CONFIG, c, min(c, 256) if c > 256 else None, batch=8)["cost"] for c in range(1, 4097))
    assert speedup(CONFIG, constant(256), 4096, batch=8, stride=1) == pytest.approx(brute)
    assert brute > 1.5
    with pytest.raises(ValueError, match="^no decode step from prompt 20 to context 10: context must exceed prompt$"):
        speedup(CONFIG, constant(8), 10, prompt=20)                   # was a ZeroDivisionError


@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("qwen3", dict(head_dim=32))])
def test_kv_bytes_are_what_a_hugging_face_cache_holds(arch, overrides):
    # Qwen3's head_dim (32 here) is not hidden / heads (64 / 4 = 16): the formula must read the config's own.
    model = tiny_model(arch, **overrides)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.randint(1, 64, (3, 11)), **{CACHE_ARG: cache}, use_cache=True)   # `cache`: transformers >= 5.24
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert kv_bytes(model.config, tokens=11, batch=3, bytes_per=4) == held
    assert kv_bytes(dict(model.config.to_dict()), 11, 3, 4) == held        # a dict of the fields reads the same


def test_speedup_names_a_bad_stride_or_prompt():
    # stride 0 was range()'s "arg 3 must not be zero", naming no argument; a negative stride read "context must
    # exceed prompt", which it did; a negative prompt priced steps at contexts <= 0 (negative kv_len): a number
    brute = sum(cost(CONFIG, c, None)["cost"] for c in range(1, 101)) / \
        sum(cost(CONFIG, c, 8 if c > 8 else None)["cost"] for c in range(1, 101))
    assert speedup(CONFIG, constant(8), 100, stride=1) == pytest.approx(brute)
    for stride in (0, -64, 1.5):
        with pytest.raises(ValueError, match=f"^stride must be a positive integer, got {stride}$"):
            speedup(CONFIG, constant(8), 100, stride=stride)
    with pytest.raises(ValueError, match="^prompt must be a non-negative integer, got -10$"):
        speedup(CONFIG, constant(8), 100, prompt=-10)


def test_shape_names_the_fields_a_config_lacks():
    # GPT-2's config has no intermediate_size (its MLP is n_inner, not gated): was a TypeError, "unsupported operand
    # type(s) for *: 'int' and 'NoneType'", naming no field
    from transformers import GPT2Config
    with pytest.raises(ValueError, match="^the cost model reads a Llama-style config \\(gated MLP\\); this one has no "
                                         "intermediate_size$"):
        shape(GPT2Config())
    with pytest.raises(ValueError, match="no intermediate_size, num_hidden_layers, num_attention_heads, vocab_size$"):
        shape(dict(hidden_size=8))


def test_cost_names_a_bad_context_batch_dense_layers_page_size_or_budget():
    # each was priced: dense_layers -1 as 3 sparse layers of 2 (1184 FLOPs, less than the weights' 2 * 1232 alone),
    # page_size 0 as an eviction policy (no pages scored), context -5 and batch 0 as steps that compute nothing
    assert cost(CONFIG, 100, 20)["flops"] == 2 * 1232 + 4 * 2 * 4 * 40     # the hand count: 2 layers read 20 each
    for kwargs, message in ((dict(dense_layers=-1), "dense_layers must be a non-negative integer, got -1"),
                            (dict(page_size=0), "page_size must be a positive integer, got 0"),
                            (dict(context=-5), "context must be a positive integer, got -5"),
                            (dict(batch=0), "batch must be a positive integer, got 0"),
                            # budget -5 priced each layer's kv_len at -5: 2144 FLOPs, less than the weights' 2464
                            (dict(budget=-5), "budget must be a positive integer, got -5"),
                            (dict(budget=0), "budget must be a positive integer, got 0"),
                            (dict(budget=2.5), "budget must be a positive integer, got 2.5")):
        with pytest.raises(ValueError, match=f"^{message}$"):
            cost(CONFIG, **dict(dict(context=100, budget=20), **kwargs))


def test_cost_refuses_dense_layers_for_an_evicting_cache():
    # dense_layers without page_size priced an evicting cache with dense layers, which KVCache never has (only
    # block top-k keeps them: kvcache.py)
    with pytest.raises(ValueError, match="^dense_layers=1 is block top-k's"):
        cost(CONFIG, 100, 20, dense_layers=1)
    assert cost(CONFIG, 100, 4, page_size=4, dense_layers=1)["flops"] > cost(CONFIG, 100, 4, page_size=4)["flops"]


def test_a_blocktopk_budget_that_covers_the_context_still_scores_its_pages():
    # KVCache scores every page at every decode step whatever the budget (a schedule's dense bin: DENSE), and
    # attends them all: it was priced as a dense model (budget None), the page scoring left out. By hand, 100
    # tokens, pages of 4, both layers paged: each reads 100 tokens and scores 25 mean keys (kv_heads 1, dim 4)
    for budget in (100, 400, DENSE):
        c = cost(CONFIG, context=100, budget=budget, page_size=4, bytes_per=2, intensity=10)
        assert c["flops"] == 2 * 1232 + 4 * 2 * 4 * (100 + 100) + 2 * (2 * 1 * 4 * 25)
        assert c["bytes"] == 2 * (1232 + 2 * 1 * 4 * (100 + 100)) + 2 * 2 * (1 * 4 * 25)
    assert cost(CONFIG, 100, None, page_size=4) == cost(CONFIG, 100, None)   # None: a dense model, no pages
    assert cost(CONFIG, 100, 400) == cost(CONFIG, 100, None)                 # an eviction cache under budget: dense


@pytest.mark.parametrize("family", ["PhiConfig", "GPTNeoXConfig", "Starcoder2Config"])
def test_shape_refuses_a_family_whose_mlp_is_not_gated(family):
    # Phi, GPT-NeoX and StarCoder2 have every field shape reads, but two MLP matrices, not three: GPT-NeoX-20B's
    # config was priced at 26.9e9 matmul parameters (by hand, 44 x (4 x 6144^2 + 2 x 6144 x 24576) + 50432 x 6144
    # = 20.2e9 with a two-matrix MLP), silently. The families the hook runs (all gated) still pass, config or dict.
    import transformers
    config = getattr(transformers, family)()
    with pytest.raises(ValueError, match=f"^the cost model prices a gated MLP, as model_type llama, mistral, qwen2 "
                                         f"and qwen3 have; got model_type '{config.model_type}'$"):
        shape(config)
    with pytest.raises(ValueError, match=f"got model_type '{config.model_type}'$"):
        kv_bytes(config.to_dict(), 1)
    for gated in (transformers.LlamaConfig(), transformers.MistralConfig(), transformers.Qwen2Config(),
                  transformers.Qwen3Config()):
        assert shape(gated) == shape(gated.to_dict())


def test_the_defaults_are_bf16_bytes_one_row_and_the_h100_balance():
    # Pins the defaults every caller leans on (bench.py's memory check, schedule.py's --speedup table): bf16, 2 bytes
    # a value; one row; the H100's 989 TFLOP/s bf16 over 3.35 TB/s of HBM, ~295 FLOPs a byte. Every other test
    # passes them explicitly or compares cost with cost, so a default of 4 bytes, batch 2 or intensity 295 passed.
    assert kv_bytes(CONFIG, 10) == 2 * 2 * 1 * 4 * 10 * 2                   # K and V, 2 layers, 1 kv head, dim 4: 320
    assert cost_module.H100_INTENSITY == pytest.approx(295.22388, rel=1e-6)
    # by hand: both layers read 20 tokens; 2 * 1232 + 4 * 2 * 4 * 40 FLOPs, 2 bytes * (1232 + 2 * 1 * 4 * 40)
    c = cost(CONFIG, 100, 20)
    assert (c["flops"], c["bytes"]) == (3744, 3104)
    assert c["cost"] == pytest.approx(3744 + 989e12 / 3.35e12 * 3104, rel=1e-12)


def test_speedup_prices_dense_as_a_model_without_a_cache_and_steps_every_64_tokens_by_default():
    # Pins speedup's dense baseline: a dense model (budget None), which scores no page, not a blocktopk cache at
    # budget DENSE (which does); and its default stride, 64: the steps at contexts 1, 65, 129, 193 of 200.
    # Reference: the brute-force sums of cost over those steps.
    kw = dict(page_size=4, dense_layers=1)
    brute = sum(cost(CONFIG, c, None)["cost"] for c in range(1, 101)) / \
        sum(cost(CONFIG, c, 8, **kw)["cost"] for c in range(1, 101))
    assert speedup(CONFIG, constant(8), 100, stride=1, **kw) == pytest.approx(brute, rel=1e-12)
    brute = sum(cost(CONFIG, c, None)["cost"] for c in (1, 65, 129, 193)) / \
        sum(cost(CONFIG, c, min(c, 8))["cost"] for c in (1, 65, 129, 193))
    assert speedup(CONFIG, constant(8), 200) == pytest.approx(brute, rel=1e-12)


def test_speedup_table_prices_each_qwen3_shape_at_the_batch_and_pages_given():
    # Pins what `schedule.py --speedup` prints: each cell is speedup() of that Qwen3 shape at the table's batch and
    # blocktopk pages (a table that dropped batch or pages printed batch 1 or eviction prices under their heading),
    # and Sparrow's reported row is docs/method.md section 6's 2.2x, 2.4x, 2.0x
    pages = dict(page_size=16, dense_layers=2)
    table = cost_module.speedup_table([("c256", constant(256))], 4096, 8, "blocktopk", **pages)
    cells = [f"{speedup(QWEN3[n], constant(256), 4096, batch=8, **pages):.2f}x" for n in ("Qwen3-1.7B", "Qwen3-4B",
                                                                                          "Qwen3-8B")]
    assert cells != [f"{speedup(QWEN3[n], constant(256), 4096, **pages):.2f}x" for n in QWEN3]      # batch matters
    assert cells != [f"{speedup(QWEN3[n], constant(256), 4096, batch=8):.2f}x" for n in QWEN3]      # pages matter
    assert f"| c256 | {' | '.join(cells)} |" in table.splitlines()
    assert "| Sparrow reported (block top-k, threshold 0.86) | 2.2x | 2.4x | 2.0x |" in table.splitlines()
    assert "blocktopk, 4096 tokens decoded at batch 8" in table
