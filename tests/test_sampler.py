"""The sampler against Hugging Face `generate`, a dense forward pass and a masked dense pass; and proof that
no decode step reads a device value on the host (the host runs ahead of a GPU)."""
import gc
import warnings
import weakref

import numpy as np
import pytest
import torch

import kvcache
import sampler
from kvcache import SparseConfig
from reference import HostReads, full_forward_logprobs, hf_greedy, masked_dense_logprobs, tiny_model
from sampler import generate, sample_token

PROMPTS = [[5, 9, 3, 7, 1, 12, 33, 8, 2], [4, 17, 6], [21, 22, 23, 24, 25, 26]]


@pytest.mark.parametrize("arch, overrides", [
    ("llama", {}), ("qwen2", {}), ("qwen3", {}),
    ("mistral", {"sliding_window": 6}),     # a window shorter than the sequence: exercised, not skipped
    ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),   # layer 1 slides, 0 does not
])
def test_full_cache_greedy_equals_hugging_face(arch, overrides):
    model = tiny_model(arch, **overrides)
    ours = generate(model, PROMPTS, SparseConfig("full"), max_new_tokens=24, temperature=0)
    theirs = hf_greedy(model, PROMPTS, 24)
    assert torch.equal(ours.tokens, theirs)
    assert ours.mask.bool().all()
    for row, prompt in enumerate(PROMPTS):
        dense = full_forward_logprobs(model, prompt, ours.tokens[row].tolist())
        assert torch.allclose(ours.logprobs[row], dense, atol=1e-4)


@pytest.mark.parametrize("step", [5, 0])
def test_rows_stop_at_eos_like_hugging_face(step):
    model = tiny_model("llama")
    eos = hf_greedy(model, PROMPTS, 24)[0, step].item()              # a token row 0 emits at `step` (0: its first)
    ours = generate(model, PROMPTS, SparseConfig("full"), max_new_tokens=24, temperature=0, eos_token_id=eos)
    theirs = hf_greedy(model, PROMPTS, 24, eos_token_id=eos)
    T = theirs.shape[1]
    assert torch.equal(ours.tokens[:, :T], theirs) and (ours.tokens[:, T:] == 0).all()
    first_eos = (ours.tokens[0] == eos).nonzero()[0].item()
    assert ours.mask[0, : first_eos + 1].bool().all() and not ours.mask[0, first_eos + 1:].bool().any()
    assert (ours.logprobs[ours.mask == 0] == 0).all()


def test_after_a_row_ends_its_topk_is_cleared_as_its_logprobs_and_tokens_are():
    # Rollouts' promise for every per-step field past a row's EOS (mask 0): tokens pad_token_id, logprobs 0, and
    # likewise topk_logprobs 0 and topk_ids pad_token_id; on live steps the top-k is a dense pass's top-k
    model = tiny_model("llama")
    eos = hf_greedy(model, PROMPTS, 24)[0, 2].item()
    out = generate(model, PROMPTS, SparseConfig("full"), max_new_tokens=24, temperature=0, eos_token_id=eos,
                   pad_token_id=7, logprobs_topk=4)
    ended = out.mask == 0
    assert ended.any() and (out.tokens[ended] == 7).all() and (out.topk_ids[ended] == 7).all()
    assert (out.topk_logprobs[ended] == 0).all()
    for row, prompt in enumerate(PROMPTS):
        live = int(out.mask[row].sum())
        ids = prompt + out.tokens[row, :live].tolist()
        logits = model(torch.tensor([ids])).logits[0, len(prompt) - 1: len(ids) - 1].float()
        top = logits.log_softmax(-1).topk(4)
        assert torch.equal(out.topk_ids[row, :live], top.indices)
        assert torch.allclose(out.topk_logprobs[row, :live], top.values, atol=1e-4)


@pytest.mark.parametrize("policy, interval", [
    ("streaming", 2), ("h2o", 2), ("snapkv", 2), ("rkv", 2), ("random", 2), ("snapkv", 1), ("h2o", 5)])
def test_eviction_equals_masking(policy, interval):
    model = tiny_model("llama")
    sparse = SparseConfig(policy, budget=8, interval=interval, window=2, sink=2, kernel=3)
    out = generate(model, PROMPTS, sparse, max_new_tokens=30, temperature=1.0, seed=3, record=True)
    masked = masked_dense_logprobs(model, out)
    assert torch.allclose(out.logprobs, masked, atol=1e-4)
    # and eviction really changed the distribution: the unmasked dense pass disagrees
    dense = torch.stack([full_forward_logprobs(model, p, out.tokens[i].tolist()) for i, p in enumerate(PROMPTS)])
    assert (out.logprobs - dense).abs().max() > 1e-2


def test_a_list_of_eos_ids_ends_each_row_at_the_first_of_them_like_hugging_face():
    # Hugging Face's generation configs name several end ids (Qwen2.5-Instruct: <|im_end|> and <|endoftext|>);
    # `token == [a, b]` was False, so every row ran on to max_new_tokens, its mask 1 past its end
    model = tiny_model("llama")
    greedy = hf_greedy(model, PROMPTS, 24)
    eos = [greedy[0, 3].item(), greedy[2, 6].item()]                  # row 0 ends at step 3 at the latest
    theirs = hf_greedy(model, PROMPTS, 24, pad_token_id=7, eos_token_id=eos)
    ours = generate(model, PROMPTS, SparseConfig("full"), max_new_tokens=24, temperature=0, eos_token_id=eos,
                    pad_token_id=7)
    T = theirs.shape[1]
    assert T < 24 and torch.equal(ours.tokens[:, :T], theirs) and (ours.tokens[:, T:] == 7).all()
    ends = [next(t for t, token in enumerate(row.tolist()) if token in eos) for row in ours.tokens]
    assert ours.mask.tolist() == [[1.0] * (end + 1) + [0.0] * (ours.tokens.shape[1] - end - 1) for end in ends]


def test_sampling_draws_what_hugging_face_draws_from_the_same_seed():
    # generate's noise (sample_token) is torch.multinomial's draw from a generator seeded as torch.manual_seed seeds
    # the global one: with the same seed, temperature and top-p, Hugging Face's sampling (top_k off) picks the same
    # tokens for a left-padded batch, rows ending at an EOS and padded with a pad id that is not 0
    model = tiny_model("qwen3")
    P = max(map(len, PROMPTS))
    ids = torch.tensor([[7] * (P - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in PROMPTS])
    def hugging_face(temperature, top_p, eos):
        torch.manual_seed(5)
        return model.generate(ids, attention_mask=mask, do_sample=True, temperature=temperature, top_p=top_p,
                              top_k=0, max_new_tokens=20, min_new_tokens=0, pad_token_id=7, eos_token_id=eos)[:, P:]
    for temperature, top_p in [(1.0, 1.0), (0.7, 0.8)]:
        eos = hugging_face(temperature, top_p, None)[1, 4].item()        # row 1 ends at step 4 at the latest
        for end in (None, eos):
            theirs = hugging_face(temperature, top_p, end)
            ours = generate(model, PROMPTS, SparseConfig("full"), max_new_tokens=20, temperature=temperature,
                            top_p=top_p, eos_token_id=end, pad_token_id=7, seed=5)
            T = theirs.shape[1]
            assert torch.equal(ours.tokens[:, :T], theirs) and (ours.tokens[:, T:] == 7).all()
            assert end is None or ours.mask[1].sum() <= 5                  # row 1 ended


def test_every_row_ends_at_its_eos_and_the_rollout_at_the_last_one(monkeypatch):
    # a token all three rows emit (greedy: first at steps 2, 21 and 1) is the EOS. Hugging Face stops when every
    # row has ended: tokens [N, T] with T = the last EOS + 1; mask 1 up to and including each row's EOS;
    # new_tokens counts those ones; kept [T, N, H_kv, S] per layer, a full cache's step t (0: the prefill)
    # attending to positions 0 .. len(prompt) + t - 1 of its row, once each, -1 elsewhere; and the loop stops
    # within DONE_EVERY steps of the last EOS (not at max_new_tokens), the cache counting the steps it ran
    model = tiny_model("llama")
    greedy = hf_greedy(model, PROMPTS, 24)
    eos = next(t for t in range(64) if all((row == t).any() for row in greedy))
    ends = [(row == eos).nonzero()[0].item() for row in greedy]
    T, steps, decode = max(ends) + 1, [], sampler.decode
    monkeypatch.setattr(sampler, "decode", lambda *args, **kwargs: steps.append(1) or decode(*args, **kwargs))
    out = generate(model, PROMPTS, SparseConfig("full"), max_new_tokens=40, temperature=0, eos_token_id=eos,
                   record=True)
    assert len(set(ends)) == 3 and max(ends) + sampler.DONE_EVERY < 40 - 1
    assert torch.equal(out.tokens, hf_greedy(model, PROMPTS, 40, eos_token_id=eos)) and out.tokens.shape[1] == T
    assert out.mask.tolist() == [[1.0] * (end + 1) + [0.0] * (T - end - 1) for end in ends]
    assert out.stats["new_tokens"] == sum(end + 1 for end in ends)
    assert max(ends) <= len(steps) < max(ends) + sampler.DONE_EVERY
    assert out.stats["dense_kv_tokens"] == max(map(len, PROMPTS)) + len(steps)
    for layer in out.kept:
        assert layer.shape[:2] == (T, 3)
        for t in range(T):
            for row, prompt in enumerate(PROMPTS):
                for head in layer[t, row]:
                    assert sorted(head[head >= 0].tolist()) == list(range(len(prompt) + t))
                    assert (head[head < 0] == -1).all()


def test_eviction_equals_masking_qwen3_sliding_mistral():
    for arch, overrides in [("qwen3", {}), ("mistral", {"sliding_window": 12}),
                            ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1))]:
        model = tiny_model(arch, **overrides)
        out = generate(model, PROMPTS, SparseConfig("rkv", budget=8, interval=3, window=2, sink=2),
                       max_new_tokens=25, temperature=1.0, record=True)
        assert torch.allclose(out.logprobs, masked_dense_logprobs(model, out), atol=1e-4)


@pytest.mark.parametrize("sparse", [
    SparseConfig("full"), *(SparseConfig(p, budget=8, interval=3, window=2, sink=2, kernel=3)
                            for p in ("streaming", "h2o", "snapkv", "rkv", "random")),
    SparseConfig("blocktopk", budget=4, page_size=4, dense_layers=1)], ids=lambda s: s.policy)
def test_a_prompt_alone_samples_what_it_samples_inside_a_padded_batch(sparse):
    # rows of lengths 9, 3 and 6 fall due on different steps and each compresses several times
    model = tiny_model("qwen2")
    batch = generate(model, PROMPTS, sparse, max_new_tokens=30, temperature=0)
    for row, prompt in enumerate(PROMPTS):
        alone = generate(model, [prompt], sparse, max_new_tokens=30, temperature=0)
        assert torch.equal(batch.tokens[row], alone.tokens[0])
        assert (batch.logprobs[row] - alone.logprobs[0]).abs().max() < 1e-5
        if sparse.policy not in ("full", "blocktopk"):
            assert alone.stats["compressions"] >= 5


def test_sampling_is_reproducible_per_seed_and_top_p_narrows_it():
    model = tiny_model("llama")
    run = lambda seed, top_p=1.0: generate(model, PROMPTS, SparseConfig("full"), max_new_tokens=16,
                                           temperature=1.0, top_p=top_p, seed=seed).tokens
    assert torch.equal(run(1), run(1)) and not torch.equal(run(1), run(2))
    greedy = generate(model, PROMPTS, SparseConfig("full"), max_new_tokens=16, temperature=0).tokens
    assert torch.equal(run(1, top_p=1e-6), greedy)                   # the nucleus is the argmax alone


@pytest.mark.parametrize("top_p, nucleus", [(0.5, [1]), (0.6, [1, 3]), (0.75, [1, 3]), (0.76, [0, 1, 3]),
                                            (0.875, [0, 1, 3]), (1.0, [0, 1, 2, 3, 4])])
def test_top_p_keeps_the_smallest_set_of_likeliest_tokens_whose_mass_reaches_it(top_p, nucleus):
    # probabilities exact in binary, [1/8, 1/2, 1/16, 1/4, 1/16]: the nucleus by hand (1/2 + 1/4 reaches 0.75
    # exactly, so 0.75 keeps two tokens); 400 draws [400, 5] equal torch.multinomial's from the nucleus alone
    probs = torch.tensor([[0.125, 0.5, 0.0625, 0.25, 0.0625]]).expand(400, 5)
    inside = torch.zeros(5)
    inside[nucleus] = 1.0
    ours, theirs = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    expected = torch.multinomial(probs * inside, 1, generator=theirs)[:, 0]
    drawn = sample_token(probs.log(), 1.0, top_p, torch.empty_like(probs).exponential_(generator=ours))
    assert torch.equal(drawn, expected) and set(drawn.tolist()) == set(nucleus)


def test_recorded_topk_is_the_sampler_distribution():
    model = tiny_model("llama")
    out = generate(model, PROMPTS[:1], SparseConfig("full"), max_new_tokens=6, temperature=0.7, logprobs_topk=64)
    assert torch.allclose(out.topk_logprobs.exp().sum(-1), torch.ones(1, 6), atol=1e-5)  # k = vocab: all mass
    chosen = out.topk_logprobs.gather(-1, (out.topk_ids == out.tokens[..., None]).float().argmax(-1, keepdim=True))
    assert torch.allclose(chosen[..., 0], out.logprobs)
    dense = full_forward_logprobs(model, PROMPTS[0], out.tokens[0].tolist(), temperature=0.7)
    assert torch.allclose(out.logprobs[0], dense, atol=1e-4)


def test_a_topk_larger_than_the_vocabulary_records_the_whole_distribution():
    # logprobs_topk (default correction.ALPHA_TOPK = 64) above a 32-token vocabulary is cut to the vocabulary:
    # every step records all 32 log-probs, each id once, best first, summing to 1 (asking topk for 64 of 32 fails)
    model = tiny_model("llama", vocab_size=32)
    out = generate(model, [[5, 9, 3], [4, 17, 6, 30]], SparseConfig("full"), max_new_tokens=5, temperature=1.0)
    assert out.topk_logprobs.shape == out.topk_ids.shape == (2, 5, 32)
    assert torch.equal(out.topk_ids.sort(-1).values, torch.arange(32).expand(2, 5, 32))
    assert torch.allclose(out.topk_logprobs.exp().sum(-1), torch.ones(2, 5), atol=1e-5)
    assert (out.topk_logprobs.diff(dim=-1) <= 0).all()


def test_the_random_policy_evicts_as_the_seed_says():
    # greedy decoding draws no noise: what differs between seeds is only the random policy's choice of evictions
    model = tiny_model("llama")
    kept = lambda seed: generate(model, PROMPTS, SparseConfig("random", budget=8, interval=2, window=2),
                                 max_new_tokens=20, temperature=0, seed=seed, record=True).kept
    assert all(torch.equal(a, b) for a, b in zip(kept(1), kept(1)))
    assert not all(torch.equal(a, b) for a, b in zip(kept(1), kept(2)))


def test_bfloat16_runs_close_to_float32():
    model = tiny_model("llama")
    fp32 = generate(model, PROMPTS, SparseConfig("snapkv", budget=8, interval=2, window=2), max_new_tokens=8,
                    temperature=0)
    bf16 = generate(model.to(torch.bfloat16), PROMPTS, SparseConfig("snapkv", budget=8, interval=2, window=2),
                    max_new_tokens=8, temperature=0)
    assert bf16.stats["peak_kv_bytes"] * 2 == fp32.stats["peak_kv_bytes"]
    assert (bf16.tokens[:, 0] == fp32.tokens[:, 0]).all()
    assert (bf16.logprobs[:, 0] - fp32.logprobs[:, 0]).abs().max() < 0.1
    # the log-softmax runs on the bf16 logits upcast to fp32 (sampler.forward), as Hugging Face's own dense bf16
    # forward scored in fp32 gives them: the first token (the prefill, nothing evicted) to ~1e-4. A log-softmax in
    # bf16 rounds each log-prob to its 2**-6 grid near -4 (~8e-3 off), and its top-k stays bf16
    dense = torch.stack([full_forward_logprobs(model, p, bf16.tokens[i, :1].tolist()) for i, p in enumerate(PROMPTS)])
    assert (bf16.logprobs[:, :1] - dense).abs().max() < 1e-3
    assert bf16.logprobs.dtype == bf16.topk_logprobs.dtype == torch.float32


@pytest.mark.parametrize("prompts, kwargs, message", [
    ([], {}, "prompts must be a non-empty list"),
    ([[1, 2], []], {}, "prompt 1 is empty"),
    ([[1, 99]], {}, "token ids outside \\[0, 64\\)"),
    ([[1, 64]], {}, "token ids outside \\[0, 64\\): min 1, max 64"),      # the vocabulary's first id past its end
    ([[0, -1]], {}, "token ids outside \\[0, 64\\): min -1, max 0"),
    ([[True, 2]], {}, "^prompt 0 holds True: token ids are integers \\(no bool, float or text\\)$"),        # was: token 1
    ([[1, 2], [1.7, 2]], {}, "^prompt 1 holds 1.7: token ids are integers"),       # was: cut to 1, silently
    ([[1, "2"]], {}, "^prompt 0 holds '2': token ids are integers"),                 # was: a TypeError from min()
    (["What is 2+2?"], {}, "^prompt 0 is text, 'What is 2\\+2\\?': prompts are token ids \\(tokenize it first\\)$"),
    ([[1, 2], b"\x01\x02"], {}, "^prompt 1 is text, b'\\\\x01\\\\x02': prompts are token ids"),   # was: 'holds 1'
    ([1, 5, 7], {}, "^prompt 0 is 1, no list of token ids \\(one prompt: \\[\\[1, 5, 7\\]\\]\\)$"),   # was: a TypeError
    ([[1, 2]], dict(logprobs_topk=0), "logprobs_topk must be a positive integer, got 0"),
    ([[1, 2]], dict(logprobs_topk=True), "logprobs_topk must be a positive integer, got True"),   # was: a TypeError
    ([[1, 2]], dict(max_new_tokens=True), "max_new_tokens must be a positive integer, got True"),   # was: 1 token
    ([[1, 2]], dict(max_new_tokens=0), "max_new_tokens must be a positive integer, got 0"),
    ([[1, 2, 3], [4]], dict(max_new_tokens=510), "max_new_tokens \\(--max-new-tokens\\) 510: the longest prompt "
                                                 "\\(3 tokens\\) plus the response must fit the model's 512 positions, "
                                                 "so at most 509"),
    ([[1, 2]], dict(temperature=-0.5), "temperature must be 0 \\(greedy\\) or a finite number >= 1e-06, got -0.5"),
    # logits / 1e-40 overflow float32: every row sampled token 0, with NaN log-probs
    ([[1, 2]], dict(temperature=1e-40), "temperature must be 0 \\(greedy\\) or a finite number >= 1e-06, got 1e-40"),
    ([[1, 2]], dict(temperature=float("nan")), "temperature must be 0 .*, got nan"),  # was: NaN
    ([[1, 2]], dict(temperature=float("inf")), "temperature must be 0 .*, got inf"),  # log-probs
    ([[1, 2]], dict(pad_token_id=64), "pad_token_id must be a token id in \\[0, 64\\), got 64"),   # was: an IndexError
    ([[1, 2]], dict(pad_token_id=None), "pad_token_id must be a token id in \\[0, 64\\), got None"),  # mid-rollout
    ([[1, 2]], dict(eos_token_id=64), "eos_token_id must be a token id in \\[0, 64\\) or a list of them, got 64"),
    ([[1, 2]], dict(eos_token_id=[3, -1]), "eos_token_id must be .* or a list of them, got \\[3, -1\\]"),
    ([[1, 2]], dict(eos_token_id="2"), "eos_token_id must be .*, got '2'"),
    ([[1, 2]], dict(eos_token_id=True), "eos_token_id must be .*, got True"),                # True is no id 1
    ([[1, 2]], dict(eos_token_id=[3, False]), "eos_token_id must be .*, got \\[3, False\\]"),
    ([[1, 2]], dict(pad_token_id=True), "pad_token_id must be a token id in \\[0, 64\\), got True"),
    ([[1, 2]], dict(eos_token_id=torch.tensor([3, 4])), "eos_token_id must be .*, got tensor\\(\\[3, 4\\]\\)"),
    # a 0-d bool tensor is no id 1, as True is not (pins integer's dtype check: operator.index takes tensor(True))
    ([[1, 2]], dict(eos_token_id=torch.tensor(True)), "eos_token_id must be .*, got tensor\\(True\\)"),
    ([[1, 2]], dict(top_p=0.0), "top_p must lie in \\(0, 1\\], got 0.0"),
    ([[1, 2]], dict(top_p=1.5), "top_p must lie in \\(0, 1\\], got 1.5"),
    ([[1, 2]], dict(temperature=None), "temperature must be 0 .*, got None"),   # were a
    ([[1, 2]], dict(temperature="0.7"), "temperature must be 0 .*, got '0.7'"),   # TypeError
    ([[1, 2]], dict(top_p=None), "top_p must lie in \\(0, 1\\], got None"),                         # from `<`
    ([[1, 2]], dict(top_p=torch.tensor(0.5)), "top_p must lie in .*, got tensor\\(0.5000\\)"),   # was: "got 0.5"
    ([[1, 2]], dict(seed=1.5), "^seed must be an integer in \\[-2\\*\\*63, 2\\*\\*64\\), got 1.5$"),   # these three
    ([[1, 2]], dict(seed=None), "^seed must be an integer .*, got None$"),               # were a RuntimeError
    ([[1, 2]], dict(seed=True), "^seed must be an integer .*, got True$"),               # from manual_seed
    ([[1, 2]], dict(seed=2 ** 64), "^seed must be an integer .*, got 18446744073709551616$"),
    ([[1, 2]], dict(sparse="snapkv"), "^sparse must be a SparseConfig \\(None: the full cache\\), got 'snapkv'$"),
    ([[1, 2]], dict(captured="False"), "^captured must be True or False, got 'False'$"),   # was: a captured run
    ([[1, 2]], dict(record=None), "^record must be True or False, got None$"),          # was: taken as False
])
def test_bad_input_is_refused_before_any_forward_pass(prompts, kwargs, message):
    model = tiny_model("llama")
    calls = []
    model.register_forward_pre_hook(lambda *args: calls.append(1))
    with pytest.raises(ValueError, match=message):
        generate(model, prompts, **{"sparse": SparseConfig("full"), **kwargs})
    assert calls == []


@pytest.mark.parametrize("ids", [np.array, torch.tensor], ids=["numpy", "torch"])
def test_token_ids_from_numpy_or_a_tensor_are_taken_as_the_integers_they_are(ids):
    # a numpy array's (or a tensor's) elements are no Python ints: np.int64(7) was refused as an EOS or padding id,
    # while the same prompts were taken; the rollouts' prompts are plain lists of ints, whatever came in
    model = tiny_model("llama")
    greedy = hf_greedy(model, PROMPTS, 24)
    eos = [greedy[0, 3].item(), greedy[2, 6].item()]
    theirs = hf_greedy(model, PROMPTS, 24, pad_token_id=7, eos_token_id=eos)
    ours = generate(model, [ids(p) for p in PROMPTS], SparseConfig("full"), max_new_tokens=24, temperature=0,
                    eos_token_id=list(ids(eos)), pad_token_id=ids(7))
    T = theirs.shape[1]
    assert T < 24 and torch.equal(ours.tokens[:, :T], theirs) and (ours.tokens[:, T:] == 7).all()
    assert ours.prompts == PROMPTS and all(type(t) is int for p in ours.prompts for t in p)
    alone = generate(model, PROMPTS, SparseConfig("full"), max_new_tokens=24, temperature=0, eos_token_id=ids(eos[0]))
    assert torch.equal(alone.tokens, hf_greedy(model, PROMPTS, 24, eos_token_id=eos[0]))


def test_select_keeps_the_rows_it_names_and_refuses_a_mask():
    # a boolean mask [F, T, T] was turned into the row numbers [0, 1, 1]: rows 0 and 1, the second twice
    model = tiny_model("llama")
    out = generate(model, PROMPTS, SparseConfig("full"), max_new_tokens=4, temperature=1.0, record=True)
    part = out.select([2, 0])
    assert part.prompts == [PROMPTS[2], PROMPTS[0]] and torch.equal(part.tokens, out.tokens[[2, 0]])
    assert all(torch.equal(a, b[:, [2, 0]]) for a, b in zip(part.kept, out.kept))
    for mask in ([False, True, True], torch.tensor([False, True, True])):
        with pytest.raises(ValueError, match="^select takes row numbers, not a mask"):
            out.select(mask)
    # 0.5 was cut to row 0; a number, a 2-D index, a row past the end failed inside (TypeError, IndexError)
    for bad in ([0.5], 1, [[0, 1]], [3], [-4]):
        with pytest.raises(ValueError, match=r"^select takes a list or 1-D tensor of row numbers in \[-3, 3\), got"):
            out.select(bad)
    assert out.select([]).tokens.shape == (0, out.tokens.shape[1])     # [] (a float tensor): no rows, as before


def test_a_generation_may_fill_the_models_positions_exactly():
    # the refusal above starts one token past max_position_embeddings; HF's generate goes that far too
    model = tiny_model("llama", max_position_embeddings=16)
    prompts = [[1, 2, 3, 4], [5, 6]]
    out = generate(model, prompts, SparseConfig("full"), max_new_tokens=12, temperature=0, eos_token_id=None)
    assert torch.equal(out.tokens, hf_greedy(model, prompts, 12))


def test_a_model_without_max_position_embeddings_is_not_limited():
    # Pins check_length's `positions is not None`: a config that names no position limit (no such field) refuses
    # nothing; without that guard, `longest + new > None` would raise a TypeError for every generation
    from types import SimpleNamespace
    sampler.check_length(3, 10 ** 9, SimpleNamespace())
    with pytest.raises(ValueError, match="so at most 13"):
        sampler.check_length(3, 14, SimpleNamespace(max_position_embeddings=16))
    with pytest.raises(ValueError, match="^the longest prompt \\(16 tokens\\) leaves none of the model's 16 positions"):
        sampler.check_length(16, 1, SimpleNamespace(max_position_embeddings=16))   # was: "so at most 0"


def test_the_first_and_last_token_ids_are_accepted():
    # 0 and vocab_size - 1 are prompt tokens like any other (the refusals above start just outside them)
    model = tiny_model("llama")
    prompts = [[0, 63, 5], [63, 0]]
    out = generate(model, prompts, SparseConfig("full"), max_new_tokens=4, temperature=0)
    assert torch.equal(out.tokens, hf_greedy(model, prompts, 4))


@pytest.mark.parametrize("captured", [False, True])
def test_a_rollout_passes_the_cache_under_the_name_this_transformers_knows(captured):
    # transformers 5.24 renamed the forward's `past_key_values` to `cache`: the old name warns (FutureWarning),
    # and goes in 5.40, while 5.17 knows only the old one; kvcache.CACHE_ARG is whichever this version takes
    model = tiny_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        generate(model, PROMPTS, SparseConfig("snapkv", budget=8, interval=2, window=2), max_new_tokens=6,
                 temperature=0, captured=captured)


@pytest.mark.parametrize("sparse", [SparseConfig("full"), *(SparseConfig(p, budget=8, interval=3, window=2, sink=2, kernel=3)
                                                               for p in ("streaming", "h2o", "snapkv", "rkv", "random")),
                                    SparseConfig("blocktopk", budget=4, page_size=4, dense_layers=1)],
                         ids=lambda s: s.policy)
@pytest.mark.parametrize("record", [False, True])
def test_a_decode_step_never_waits_for_the_device(monkeypatch, sparse, record):
    # the host runs ahead of a GPU only if no decode step reads a device value: not at a compression, not with
    # record=True (DistillSparse); the cache's bookkeeping (which rows compress, budgets) is host tensors
    model, reads = tiny_model("llama"), HostReads()
    monkeypatch.setattr(sampler, "decode", reads.watch(sampler.decode))
    out = generate(model, PROMPTS, sparse, max_new_tokens=30, temperature=1.0, top_p=0.9, record=record)
    assert reads.calls == 29 and reads.seen == []
    assert out.stats["compressions"] > 0 or sparse.policy in ("full", "blocktopk")


def test_top_p_1_filters_nothing_even_where_the_float32_mass_reaches_1_early():
    # top_p = 1 is no nucleus (Hugging Face adds no top-p warper then): every token of positive probability can be
    # drawn. Here token 0 holds all but 6e-9 of the mass, so float32's cumsum reaches 1.0 at it; a nucleus built
    # anyway (`top_p <= 1.0`) would drop tokens 1-3. With the noise of token 1 tiny, the exponential race by hand,
    # argmax(p / noise), picks token 1; so does top_p 0.9999 fail to (the nucleus is token 0 alone there)
    logp = torch.log_softmax(torch.tensor([[0.0, -20.0, -20.0, -20.0]]), -1)
    assert logp.exp().cumsum(-1)[0, 0] == 1.0                          # the premise: the mass reaches 1 at token 0
    noise = torch.tensor([[1.0, 1e-12, 1.0, 1.0]])
    assert (logp.exp() / noise).argmax(-1).item() == 1                 # the race, unfiltered
    assert sample_token(logp, 1.0, 1.0, noise).item() == 1
    assert sample_token(logp, 1.0, 0.9999, noise).item() == 0


@pytest.mark.parametrize("count", [np.int64, torch.tensor], ids=["numpy", "torch"])
def test_counts_from_numpy_or_a_tensor_are_taken_as_the_integers_they_are(count):
    # max_new_tokens np.int64(4) was refused as "must be a positive integer, got np.int64(4)", while the seed and the
    # token ids take numpy integers; the rollouts equal those of the Python ints
    model = tiny_model("llama")
    ours = generate(model, PROMPTS, SparseConfig("full"), max_new_tokens=count(4), temperature=0,
                    logprobs_topk=count(3))
    assert torch.equal(ours.tokens, hf_greedy(model, PROMPTS, 4)) and ours.topk_ids.shape == (3, 4, 3)


def test_top_p_samples_from_the_nucleus_but_records_the_whole_distributions_log_probs():
    # the documented contract (generate, Rollouts.logprobs): with top_p 0.3 every token lies in its step's nucleus,
    # yet its recorded log-prob is the dense pass's at the temperature, not the nucleus's renormalised one
    model = tiny_model("llama")
    out = generate(model, PROMPTS[:1], SparseConfig("full"), max_new_tokens=8, temperature=0.7, top_p=0.3, seed=4,
                   logprobs_topk=64)
    probs = out.topk_logprobs[0].exp()                                  # [T, V]: all of it, best first
    inside = probs.cumsum(-1) - probs < 0.3
    chosen = (out.topk_ids[0] == out.tokens[0, :, None])
    assert (chosen & inside).any(-1).all()                              # drawn from the nucleus
    dense = full_forward_logprobs(model, PROMPTS[0], out.tokens[0].tolist(), temperature=0.7)
    assert torch.allclose(out.logprobs[0], dense, atol=1e-4)
    nucleus = dense - (probs * inside).sum(-1).log()                    # renormalised: what was drawn with
    assert (nucleus - dense).max() > 0.1


@pytest.mark.parametrize("captured", [False, True])
@pytest.mark.parametrize("policy", ["snapkv", "blocktopk"])
def test_a_recorded_rollout_frees_the_cache_and_keeps_what_it_attended(monkeypatch, policy, captured):
    # record=True (every --distill step): the rollouts live on through the training step, and they held the cache
    # (stats["cache"]) with its key, value, query and page buffers and a second copy of `kept`, its history: every
    # buffer a layer made must be gone (no reference left) once generate returns, and `kept` still there
    buffers = []   # weak references to every buffer a layer made

    class Watched(kvcache.Layer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made = self.k_buf, self.v_buf, self.pos_buf, getattr(self, "page_sum", None)
            buffers.extend(weakref.ref(t) for t in made if t is not None)

        def remember(self, *args):
            super().remember(*args)
            buffers.append(weakref.ref(self.queries))

    monkeypatch.setattr(kvcache, "Layer", Watched)
    sparse = SparseConfig("snapkv", budget=8, interval=3, window=2, sink=2) if policy == "snapkv" else \
        SparseConfig("blocktopk", budget=4, page_size=4, dense_layers=1)
    out = generate(tiny_model("llama"), [list(range(1, 14)), [3, 4, 5]], sparse, max_new_tokens=20,
                   temperature=1.0, record=True, captured=captured)
    gc.collect()
    assert len(buffers) >= 6 and all(ref() is None for ref in buffers)
    assert len(out.kept) == 2 and out.kept[0].shape[:3] == (20, 2, 2) and (out.kept[0][-1] >= 0).any()


def test_an_eos_id_of_0_or_a_tuple_of_ids_ends_rows_like_hugging_face():
    # end_ids: 0 is a token id like any other (a truthiness test, `not eos_token_id`, would read it as no EOS and run
    # every row to max_new_tokens), and a tuple of ids is a list of them (not one id, refused). Token 0 is made an end
    # token the model emits: its embedding and output rows are swapped with those of a token row 0 emits at step 3,
    # so the swapped model emits 0 there; the reference is Hugging Face's greedy generate with the same end ids
    model = tiny_model("llama")
    swap = hf_greedy(model, PROMPTS, 24)[0, 3].item()
    with torch.no_grad():
        for weight in (model.model.embed_tokens.weight, model.lm_head.weight):
            weight[[0, swap]] = weight[[swap, 0]]
    prompts = [[{0: swap, swap: 0}.get(t, t) for t in p] for p in PROMPTS]
    for eos in (0, (0, 63)):
        theirs = hf_greedy(model, prompts, 24, pad_token_id=7, eos_token_id=list(eos) if isinstance(eos, tuple) else eos)
        ours = generate(model, prompts, SparseConfig("full"), max_new_tokens=24, temperature=0, eos_token_id=eos,
                        pad_token_id=7)
        T = theirs.shape[1]
        assert (theirs[0] == 0).any() and torch.equal(ours.tokens[:, :T], theirs) and (ours.tokens[:, T:] == 7).all()
        first = (ours.tokens[0] == 0).nonzero()[0].item()
        assert ours.mask[0].tolist() == [1.0] * (first + 1) + [0.0] * (ours.tokens.shape[1] - first - 1)


def test_select_takes_negative_row_numbers_down_to_minus_n():
    # select's promise: row numbers in [-N, N), as Python indexes a list; -N is row 0 (a bound `-N < index.min()`
    # refused it), -1 the last row
    model = tiny_model("llama")
    out = generate(model, PROMPTS, SparseConfig("full"), max_new_tokens=4, temperature=1.0)
    part = out.select([-3, -1])
    assert part.prompts == [PROMPTS[0], PROMPTS[2]] and torch.equal(part.tokens, out.tokens[[0, 2]])
    assert torch.equal(part.logprobs, out.logprobs[[0, 2]]) and torch.equal(part.topk_ids, out.topk_ids[[0, 2]])


def test_the_smallest_temperature_allowed_samples_greedily():
    # check_args takes temperature == MIN_TEMPERATURE (the bound is inclusive: `>= 1e-06` in its message); at 1e-6
    # the distribution is the argmax's alone, so the seeded sample equals Hugging Face's greedy decoding
    model = tiny_model("llama")
    out = generate(model, PROMPTS, SparseConfig("full"), max_new_tokens=16, temperature=sampler.MIN_TEMPERATURE, seed=3)
    assert torch.equal(out.tokens, hf_greedy(model, PROMPTS, 16))


@pytest.mark.parametrize("seed", [-2 ** 63, 2 ** 64 - 1], ids=["lowest", "highest"])
def test_the_extreme_seeds_are_taken_and_sample_as_torch_seeds_them(seed):
    # check_args' seed range [-2**63, 2**64) is torch.manual_seed's: both ends are accepted (a bound `-2**63 <`
    # refused the lowest), and the draw is Hugging Face's sampling from the same seed (one prompt: no padding)
    model = tiny_model("qwen3")
    torch.manual_seed(seed)
    theirs = model.generate(torch.tensor([PROMPTS[0]]), do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                            max_new_tokens=10, min_new_tokens=0, pad_token_id=0, eos_token_id=None)[:, len(PROMPTS[0]):]
    ours = generate(model, PROMPTS[:1], SparseConfig("full"), max_new_tokens=10, temperature=1.0, seed=seed)
    assert torch.equal(ours.tokens, theirs)


def test_tokens_per_s_counts_the_live_tokens_only():
    # stats' throughput is the response tokens (mask 1) per second, not the padded [N, T] grid: rows ending at
    # different steps (EOS: a token row 0 emits at step 2) leave padding that a count of mask.numel() would add
    model = tiny_model("llama")
    eos = hf_greedy(model, PROMPTS, 24)[0, 2].item()
    out = generate(model, PROMPTS, SparseConfig("full"), max_new_tokens=24, temperature=0, eos_token_id=eos)
    live = int(out.mask.sum())
    assert live < out.mask.numel() and out.stats["new_tokens"] == live
    assert out.stats["tokens_per_s"] == pytest.approx(live / out.stats["seconds"], rel=1e-9)


@pytest.mark.parametrize("policy", ["snapkv", "blocktopk"])
@pytest.mark.parametrize("captured", [False, True])
def test_the_record_holds_positions_in_the_narrowest_integer_that_fits(policy, captured):
    # Rollouts.kept is steps x layers x H_kv x S positions a row (GBs at the papers' lengths in int64): int16 while
    # the last position fits (<= 32767), int32 one past it, the same positions either way. The rows end at their
    # first token (greedy, eos = that token), so a max_new_tokens of 32K costs only the buffers it preallocates.
    model, prompt = tiny_model("llama", max_position_embeddings=2 ** 15 + 64), [list(range(1, 14))]
    eos = hf_greedy(model, prompt, 1)[0, 0].item()
    sparse = SparseConfig(policy, budget=8, interval=3, window=2, sink=2) if policy == "snapkv" else \
        SparseConfig("blocktopk", budget=4, page_size=4)
    run = lambda new: generate(model, prompt, sparse, max_new_tokens=new, temperature=0, eos_token_id=eos,
                               record=True, captured=captured).kept
    short, fits, over = run(4), run(2 ** 15 - 13), run(2 ** 15 - 12)   # last position 32766 + 1 = 32767, 32768
    assert [k.dtype for k in short + fits] == [torch.int16] * 4 and [k.dtype for k in over] == [torch.int32] * 2
    assert all(torch.equal(a.long(), b.long()) and torch.equal(a.long(), c.long()) for a, b, c in zip(short, fits, over))
    assert sorted(short[0][0, 0, 0].tolist()) == [-1] * (short[0].shape[-1] - 13) + list(range(13))   # the prefill
