"""evaluate.py against references computed another way: Hugging Face's greedy answers one prompt at a time,
our sampler one batch at a time, the adapter switched on by hand, the exact answers counted by hand."""
import time

import pytest
import torch

import distill
import evaluate
import train
from cli import TRAINING_ONLY
from kvcache import SparseConfig
from models import toy_model
from reference import hf_greedy
from sampler import Rollouts, generate
from tasks import char_tokenizer, edit_match, encode_prompt, exact_match, make_examples, numeric_reward, reward_fn

SPARSE = SparseConfig("snapkv", 8, 2, 2, 2)   # evicts within the pick prompts' 12-27 tokens + 12 new


@pytest.fixture(scope="module")
def toy():
    """A random toy model, its tokenizer and 7 pick prompts. Its weights are drawn wide (std 0.3, not 0.02),
    so that its greedy answers differ from prompt to prompt and cache to cache (some stop early)."""
    tokenizer = char_tokenizer()
    torch.manual_seed(0)
    model = toy_model(tokenizer).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model, tokenizer, make_examples("pick", 7, 3, 3, 6)


def recorder(texts):
    """A reward that keeps each completion it is shown and pays partial credit."""
    return lambda completion, answer: texts.append(completion) or edit_match(completion, answer)


def test_rewards_read_the_response_tokens_only():
    # a vocabulary whose id 0 is a real character, as in GPT-2-style tokenizers: padding must not decode as "!"
    from tokenizers import Regex, Tokenizer, decoders, models as tok_models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    backend = Tokenizer(tok_models.WordLevel({"!": 0, "7": 1, "2": 2, "<eos>": 3}, unk_token="!"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<eos>")
    tokens = torch.tensor([[1, 2, 3, 0, 0], [1, 2, 0, 0, 0]])          # after each response: padding (id 0)
    mask = torch.tensor([[1.0, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    rollouts = Rollouts([[1], [1]], tokens, mask, torch.zeros(2, 5), torch.zeros(2, 5, 1), torch.zeros(2, 5, 1))
    rewards = evaluate.rewards_of(rollouts, [{"answer": "72"}] * 2, tok, reward_fn("sort"))
    assert rewards.tolist() == [1.0, 1.0] and rewards.dtype == torch.float32


def test_rewards_are_floats_whatever_the_reward_returns():
    # a reward may return a bool or an int (True, 1 for an exact answer): rewards_of still gives float32, which
    # eval_both averages (torch's mean refuses a tensor of ints or bools: built without float(), it raised there)
    tok = char_tokenizer()
    tokens = torch.tensor([[tok.convert_tokens_to_ids("7"), tok.eos_token_id], [tok.convert_tokens_to_ids("2"), 0]])
    mask = torch.tensor([[1.0, 1], [1, 0]])
    rollouts = Rollouts([[1], [1]], tokens, mask, torch.zeros(2, 2), torch.zeros(2, 2, 1), torch.zeros(2, 2, 1))
    for reward in (lambda completion, answer: completion == answer, lambda completion, answer: int(completion == answer)):
        rewards = evaluate.rewards_of(rollouts, [{"answer": "7"}] * 2, tok, reward)
        assert rewards.tolist() == [1.0, 0.0] and rewards.dtype == torch.float32


def test_accuracy_counts_exact_answers_not_partial_credit():
    assert evaluate.accuracy(torch.tensor([1.0, 0.5, 0.0, 1.0, 0.99])) == pytest.approx(0.4)


def test_dense_rewards_are_those_of_hugging_face_greedy_answers_in_every_batch(toy, monkeypatch):
    model, tokenizer, examples = toy
    monkeypatch.setattr(evaluate, "BATCH", 3)                         # 7 prompts: batches of 3, 3 and 1
    texts = []
    rewards = evaluate.eval_rewards(model, tokenizer, examples, recorder(texts), SparseConfig("full"), 12)
    expect = []
    for e in examples:
        new = hf_greedy(model, [encode_prompt(tokenizer, e["prompt"])], 12, tokenizer.pad_token_id,
                        tokenizer.eos_token_id)[0]
        expect.append(tokenizer.decode(new, skip_special_tokens=True))
    assert texts == expect
    assert rewards.tolist() == pytest.approx([edit_match(t, e["answer"]) for t, e in zip(expect, examples)])
    assert len(set(texts)) > 1                                         # else the order would go unchecked


def test_sparse_rewards_are_those_of_each_prompt_sampled_alone_and_both_land_in_eval_both(toy):
    model, tokenizer, examples = toy
    texts, dense = [], []
    rewards = evaluate.eval_rewards(model, tokenizer, examples, recorder(texts), SPARSE, 12)
    for e in examples:
        out = generate(model, [encode_prompt(tokenizer, e["prompt"])], SPARSE, 12, temperature=0,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        assert texts.pop(0) == tokenizer.decode(out.tokens[0, : int(out.mask.sum())], skip_special_tokens=True)
    both = evaluate.eval_both(model, tokenizer, examples, recorder(dense), SPARSE, 12)
    dense_texts, sparse_texts = dense[:7], dense[7:]                   # the first 7: dense
    dense = torch.tensor([edit_match(t, e["answer"]) for t, e in zip(dense_texts, examples)])
    assert list(both) == ["dense", "sparse", "dense_reward", "sparse_reward"]   # eval.jsonl's order
    assert both["sparse_reward"] == pytest.approx(rewards.mean().item())
    assert both["dense_reward"] == pytest.approx(dense.mean().item())
    assert both["sparse"] == pytest.approx((rewards == 1).float().mean().item())
    # the accuracies, each of its own cache: with a 0/1 reward that 4 dense and 6 sparse answers earn
    long = lambda completion, answer: float(len(completion) >= 10)
    hits = evaluate.eval_both(model, tokenizer, examples, long, SPARSE, 12)
    assert hits["dense"] == pytest.approx(sum(len(t) >= 10 for t in dense_texts) / 7)
    assert hits["sparse"] == pytest.approx(sum(len(t) >= 10 for t in sparse_texts) / 7) != hits["dense"]


def test_no_examples_is_a_clear_error_in_every_evaluation(toy):
    model, tokenizer, _ = toy                                          # was torch.cat's "expected a non-empty list"
    for run in (lambda: evaluate.eval_rewards(model, tokenizer, [], exact_match, SPARSE, 4),
                lambda: evaluate.eval_both(model, tokenizer, [], exact_match, SPARSE, 4),
                lambda: evaluate.evaluate_only(model, tokenizer, [], exact_match, [SPARSE], 4),
                lambda: evaluate.run_inference(model, tokenizer, [], exact_match, SPARSE, 4, 2)):
        with pytest.raises(ValueError, match="^no held-out examples to evaluate: the list is empty$"):
            run()


def moved_adapter(model):
    """An adapter whose B is no longer zero (as after training), so that it changes the answers."""
    lora = distill.LoRA(model, rank=4)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in lora.B.values():
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return lora


def test_the_adapter_samples_through_a_sparse_cache_only_and_never_scores(toy, monkeypatch):
    model, tokenizer, examples = toy
    lora = moved_adapter(model)

    def answers(sparse, adapter):
        texts = []
        evaluate.eval_rewards(model, tokenizer, examples, recorder(texts), sparse, 12, adapter)
        return texts

    plain = answers(SPARSE, None)
    with lora.on():                                                    # theta + phi, switched on by hand
        by_hand = answers(SPARSE, None)
    assert by_hand != plain                                            # the adapter changes answers here
    assert answers(SPARSE, lora) == by_hand and not lora.active        # and is off again afterwards
    assert answers(SparseConfig("full"), lora) == answers(SparseConfig("full"), None)
    active = {}                                                        # run_inference: sampling on, scoring off
    for module, name in ((evaluate, "generate"), (evaluate.C, "dense_logprobs")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, name=name, **k:
                            active.setdefault(name, set()).add(lora.active) or real(*a, **k))
    evaluate.run_inference(model, tokenizer, examples, exact_match, SPARSE, 12, 3, lora)
    assert active == {"generate": {True}, "dense_logprobs": {False}}


def acceptances(model, out):
    """Per-token acceptance of each response token of `out` [its tokens], by one plain forward pass of the
    model over prompt + response per rollout: sum over the sampler's top-k ids of min(p_dense, p_sampler)."""
    alphas = []
    for prompt, row, mask, ids, logp in zip(out.prompts, out.tokens, out.mask, out.topk_ids, out.topk_logprobs):
        n, start = int(mask.sum()), len(prompt) - 1                   # logits at start + t predict token t
        with torch.no_grad():
            logits = model(torch.tensor([prompt + row[:n].tolist()])).logits[0, start: start + n]   # [n, V]
        dense = logits.float().log_softmax(-1).gather(-1, ids[:n])                                    # [n, k]
        alphas.append(torch.minimum(dense.exp(), logp[:n].exp()).sum(-1))
    return torch.cat(alphas)


def test_run_inference_sums_the_batches(toy):
    model, tokenizer, examples = toy
    # partial credit: 1 for an even length, 0.5 for an odd one, so that the accuracy (the share of 1s) is not the
    # mean reward (a mutant reporting the mean passed the 0/1 reward this test had)
    even = lambda completion, answer: 1.0 if len(completion) % 2 == 0 else 0.5
    row = evaluate.run_inference(model, tokenizer, examples, even, SPARSE, 12, 3)
    peak, lengths, hits, alpha = 0, [], [], []
    for first in range(0, 7, 3):                                       # the same batches, sampled by hand
        out = generate(model, [encode_prompt(tokenizer, e["prompt"]) for e in examples[first: first + 3]], SPARSE,
                       12, temperature=0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        peak += out.stats["peak_kv_bytes"]
        n = out.mask.sum(-1).long().tolist()
        lengths += n
        hits += [even(tokenizer.decode(row[:k], skip_special_tokens=True), None) for row, k in zip(out.tokens, n)]
        alpha.append(acceptances(model, out))
    assert (row["peak_kv_bytes"], row["tokens"]) == (peak, sum(lengths))
    assert row["accuracy"] == pytest.approx(sum(h == 1 for h in hits) / len(hits)) and 0 < row["accuracy"] < 1
    alpha = torch.cat(alpha).double()                                  # [tokens], every batch's
    assert row["alpha_mean"] == pytest.approx(alpha.mean().item(), abs=1e-5)
    assert row["alpha_p05"] == pytest.approx(torch.quantile(alpha, 0.05).item(), abs=1e-5)
    assert 0 < row["alpha_p05"] < row["alpha_mean"] < 1


def test_a_run_is_scored_with_the_reward_it_trained_on(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    assert evaluate.run_reward(train.parse_args(["--model", "m", "--data", str(data)])) is numeric_reward
    assert evaluate.run_reward(train.parse_args(["--reward", "exact"])) is exact_match
    assert evaluate.run_reward(train.parse_args(["--task", "pick"])) is reward_fn("pick") is edit_match


def test_the_command_line_is_train_py_steps_0(monkeypatch):
    calls = []
    monkeypatch.setattr(train, "main", lambda argv: calls.append(argv))
    evaluate.main(["--eval-budgets", "8", "12"])
    assert calls == [["--steps", "0", "--eval-budgets", "8", "12"]]
    for steps in (["--steps", "5"], ["--step=5"], ["--steps", "-1"]):   # a prefix of a flag too; any steps but 0
        with pytest.raises(SystemExit, match="^error: evaluate.py never trains"):
            evaluate.main(steps)
    assert len(calls) == 1


def test_each_command_line_says_what_it_does_in_its_help(capsys):
    heads = {}
    for name, run in (("train", lambda: train.parse_args(["--help"])), ("evaluate", lambda: evaluate.main(["--help"]))):
        with pytest.raises(SystemExit):
            run()
        heads[name] = " ".join(capsys.readouterr().out.split("\n\n")[1].split())   # after the usage, before the flags
    assert heads["train"].startswith("Sparse-RL: GRPO on rollouts") and "Greedy" not in heads["train"]
    assert heads["evaluate"].startswith("Greedy accuracy on held-out prompts") and "GRPO on" not in heads["evaluate"]
    assert "command line of train.py" not in heads["train"] + heads["evaluate"]   # cli.py's docstring, not a command's


def test_its_help_lists_the_flags_that_count_and_it_still_takes_training_ones(capsys):
    with pytest.raises(SystemExit):
        evaluate.main(["--help"])
    shown = capsys.readouterr().out
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    everything = capsys.readouterr().out
    for dest in TRAINING_ONLY:                                         # a flag's entry opens its line
        flag = "\n  --" + dest.replace("_", "-") + " "
        assert flag in everything and flag not in shown, flag
    for flag in ("model", "policy", "budget", "eval-budgets", "max-new-tokens", "distill", "resume", "device"):
        assert f"\n  --{flag} " in shown, flag
    args = train.parse_args(["--steps", "0", "--lr", "3e-5", "--correction", "tis"], evaluate.HELP, TRAINING_ONLY)
    assert (args.lr, args.correction) == (3e-5, "tis")                 # a training command line still parses


def test_a_full_rollout_cache_is_evaluated_once_and_reads_as_dense_and_sparse(toy, monkeypatch):
    # train.py --policy full: its rollout cache is the full one, so eval_both's sparse side is the dense side
    # (greedy, the same cache); it was sampled twice, every evaluation of a dense run twice as slow as need be
    model, tokenizer, examples = toy
    dense = evaluate.eval_rewards(model, tokenizer, examples, edit_match, SparseConfig("full"), 12)
    calls = []
    real = evaluate.generate
    monkeypatch.setattr(evaluate, "generate", lambda *a, **k: calls.append(a[2].policy) or real(*a, **k))
    both = evaluate.eval_both(model, tokenizer, examples, edit_match, SparseConfig("full"), 12)
    assert calls == ["full"]                                           # one batch of 7, one pass
    mean = pytest.approx(dense.mean().item())
    assert both == dict(dense=evaluate.accuracy(dense), sparse=evaluate.accuracy(dense), dense_reward=mean,
                        sparse_reward=mean)
    assert list(both) == ["dense", "sparse", "dense_reward", "sparse_reward"]


def test_evaluate_only_runs_each_cache_once_and_a_full_one_is_the_dense_row(toy, monkeypatch, capsys):
    # a repeated --eval-budgets (8 8) or --eval-policies (snapkv snapkv) names the same cache twice, and a full
    # cache in `configs` is the dense row's own: each was sampled again, its row printed once
    model, tokenizer, examples = toy
    calls = []
    real = evaluate.generate
    monkeypatch.setattr(evaluate, "generate", lambda *a, **k: calls.append(a[2].policy) or real(*a, **k))
    long = lambda completion, answer: float(len(completion) >= 10)    # 4 of the 7 dense answers earn it
    results = evaluate.evaluate_only(model, tokenizer, examples, long,
                                     [SparseConfig("full", 8), SPARSE, SparseConfig("snapkv", 8, 2, 2, 2)], 12)
    assert calls == ["full", "snapkv"]                                 # 7 prompts: one batch per cache
    assert list(results) == ["dense", SPARSE.name]
    assert results["dense"] == pytest.approx(4 / 7)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert len(rows) == 4                                              # header, rule, dense, snapkv


def test_evaluate_only_prints_each_accuracy_to_three_decimals(monkeypatch, capsys):
    # the table as read by hand: the number of prompts in its header, 4/7 = 0.571 and 1/7 = 0.143 (the rewards
    # stand in for the caches' answers, so that the print alone is checked: '.2f' or the count of caches passed)
    fixed = {"full": torch.tensor([1.0, 1, 1, 1, 0, 0, 0.5]), "snapkv": torch.tensor([1.0, 0, 0, 0, 0, 0.9, 0])}
    monkeypatch.setattr(evaluate, "eval_rewards", lambda m, t, examples, r, sparse, *a: fixed[sparse.policy])
    results = evaluate.evaluate_only(None, None, [{}] * 7, exact_match, [SPARSE], 12)
    assert results == {"dense": pytest.approx(4 / 7), SPARSE.name: pytest.approx(1 / 7)}
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert rows == ["| cache | greedy accuracy on 7 held-out prompts |", "|---|---|", "| dense | 0.571 |",
                    f"| {SPARSE.name} | 0.143 |"]


def test_pad_to_fills_zeros_after_the_columns_of_a_2d_or_3d_tensor():
    # Pins pad_to by hand: run_inference pads each batch's [N, t] log-probs and mask and [N, t, k] top-k to
    # max_new_tokens before it concatenates the batches. Its tests' batches all run to max_new_tokens, so padding
    # the rows instead of the columns, or the front instead of the back, went unseen there
    assert evaluate.pad_to(torch.tensor([[1.0, 2], [3, 4]]), 4).tolist() == [[1, 2, 0, 0], [3, 4, 0, 0]]
    topk = torch.tensor([[[1.0, 2], [3, 4]]])                            # [1, 2, 2]
    assert evaluate.pad_to(topk, 3).tolist() == [[[1, 2], [3, 4], [0, 0]]]


def test_run_inference_times_its_own_work(toy, monkeypatch):
    # seconds: the time run_inference took, between two readings of a clock taken around it by hand (not the
    # clock's reading at the end, nor the start minus the end)
    model, tokenizer, examples = toy
    before = time.perf_counter()
    row = evaluate.run_inference(model, tokenizer, examples[:2], exact_match, SPARSE, 4, 2)
    assert 0 < row["seconds"] <= time.perf_counter() - before
    # and all of it: a clock that ticks once a read and records what had run before each read must be read
    # before the first batch's sampling and after the last batch's re-scoring, 3 batches of 7 prompts at 3, and
    # nowhere else (the loose bound above let through a clock restarted at each batch: the last batch alone)
    done, ticks, read = [], iter(range(100)), []
    for module, name in ((evaluate, "generate"), (evaluate.C, "dense_logprobs")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, name=name, **k: done.append(name) or real(*a, **k))
    monkeypatch.setattr(evaluate, "clock", lambda device: read.append(list(done)) or float(next(ticks)))
    row = evaluate.run_inference(model, tokenizer, examples, exact_match, SPARSE, 4, 3)
    assert read == [[], ["generate", "dense_logprobs"] * 3] and row["seconds"] == 1.0
