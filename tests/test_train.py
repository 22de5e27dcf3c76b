"""train.py end to end on a small warm-started toy model: metrics, checkpoints, resume, learning, errors."""
import copy
import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import cli
import models
import schedule as S
import train
from controller import HIGH
from kvcache import SparseConfig
from sampler import generate
from evaluate import accuracy, eval_rewards
from correction import ALPHA_TOPK
from tasks import char_tokenizer, encode_prompt, make_examples, reward_fn

# Short prompts (4-8 digits) so that a warm-up of 80 steps takes seconds; shared by the tests below.
SMALL = ["--task", "sort", "--digits", "4", "8", "--warmup-steps", "80", "--max-new-tokens", "10", "--eval-size", "32",
         "--prompts", "4", "--group-size", "4", "--budget", "10", "--interval", "2", "--window", "2"]
METRIC_KEYS = {"step", "reward", "accuracy", "rho_mean", "rho_min", "rho_p05", "kl_k1", "kl_k3", "alpha_mean",
               "alpha_p05", "vetoed", "dropped_tokens", "mean_weight", "clip_frac", "peak_kv_bytes", "dense_kv_bytes",
               "rollout_s", "scoring_s", "update_s", "loss", "zero_std_groups"}


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """A folder holding the cached warm-up of the small toy model (built once for the module)."""
    out = tmp_path_factory.mktemp("warm")
    args = train.parse_args(SMALL + ["--out", str(out)])
    train.load_model(args, torch.device("cpu"))
    return out / "warmup"


def run_in(folder, warm, *argv):
    """train.main in `folder`, starting from the shared warm-up; -> (model, final eval, metrics lines)."""
    if not (folder / "warmup").exists():
        shutil.copytree(warm, folder / "warmup")
    model, final = train.main(SMALL + ["--out", str(folder), *argv])
    lines = [json.loads(l) for l in (folder / "metrics.jsonl").read_text().splitlines()]
    return model, final, lines


def untimed(lines):
    """Metrics lines without their wall times, the one thing two runs of the same steps may differ in."""
    return [{k: v for k, v in l.items() if k not in {"rollout_s", "scoring_s", "update_s", "distill_s"}} for l in lines]


def test_a_run_writes_every_metric_and_a_loadable_checkpoint(tmp_path, warm):
    model, final, lines = run_in(tmp_path, warm, "--steps", "3", "--save-every", "2", "--ppo-epochs", "2",
                                 "--minibatch", "8")
    assert [l["step"] for l in lines] == [1, 2, 3]
    for line in lines:
        assert METRIC_KEYS <= set(line)
        assert line["peak_kv_bytes"] < line["dense_kv_bytes"]            # the budget evicted
    assert any(l["loss"] != 0 for l in lines)                        # some group had a signal
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000002", "step-000003"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "step-000003")
    ids = torch.tensor([[1, 15, 7, 4, 9, 14]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert set(final) == {"step", "dense", "sparse", "dense_reward", "sparse_reward"}


@pytest.mark.parametrize("online, every, evals", [
    ([], "2", [0, 2, 4]), (["--controller", "0.99", "--bin-size", "4"], "2", [0, 2, 4]),
    (["--distill", "ppo-kl"], "2", [0, 2, 4]), (["--kl", "0.05"], "2", [0, 2, 4]),
    # a longer resumed run keeps no final evaluation that an uninterrupted run lacks: the 2-step run's final
    # evaluation is at step 2; a 4-step run evaluating every 3 steps has none there
    ([], "3", [0, 3, 4])], ids=["budget", "controller", "distill", "kl", "no-final-eval-kept"])
def test_resume_gives_the_metrics_of_an_uninterrupted_run(tmp_path, warm, online, every, evals):
    _, _, straight = run_in(tmp_path / "straight", warm, "--steps", "4", "--save-every", "2", "--eval-every", every,
                            *online)
    run_in(tmp_path / "split", warm, "--steps", "2", "--save-every", "2", *online)
    _, _, resumed = run_in(tmp_path / "split", warm, "--steps", "4", "--save-every", "2", "--eval-every", every,
                           "--resume", *online)
    if "--controller" in online:   # the controller's budgets are state too: step 3 samples with moved budgets
        assert straight[2]["budget_by_bin"] != straight[0]["budget_by_bin"]
    if "--distill" in online:      # and the adapter with its optimizer: step 3 samples with theta + phi
        assert (tmp_path / "split" / "step-000002" / "adapter.safetensors").is_file()
    assert untimed(resumed) == untimed(straight)                      # steps 1-2 kept, 3-4 recomputed
    for name in ("model.safetensors", "adapter.safetensors"):           # and the final weights, bit for bit
        if (tmp_path / "straight" / "step-000004" / name).is_file():
            a, b = (load_file(tmp_path / run / "step-000004" / name) for run in ("straight", "split"))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    read = lambda name: (tmp_path / name / "eval.jsonl").read_text()
    assert read("split") == read("straight")
    assert [json.loads(l)["step"] for l in read("split").splitlines()] == evals


def test_a_run_killed_in_its_final_evaluation_and_resumed_longer_evaluates_at_its_checkpoint(tmp_path, warm,
                                                                                              monkeypatch):
    # Ctrl-C during the 2-step run's final evaluation (after its checkpoint at 2), then --resume to 4: an
    # uninterrupted 4-step run evaluates at 0, 2, 4. Was: 0, 4 (the evaluation at 2 was due, but never rerun)
    run_in(tmp_path / "straight", warm, "--steps", "4", "--save-every", "2", "--eval-every", "2")
    real, calls = train.eval_both, []
    def killed_at_the_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    monkeypatch.setattr(train, "eval_both", killed_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        run_in(tmp_path / "split", warm, "--steps", "2", "--save-every", "2", "--eval-every", "2")
    monkeypatch.setattr(train, "eval_both", real)
    run_in(tmp_path / "split", warm, "--steps", "4", "--save-every", "2", "--eval-every", "2", "--resume")
    read = lambda name: (tmp_path / name / "eval.jsonl").read_text()
    assert read("split") == read("straight") and read("split").count("\n") == 3


def test_a_schedule_file_equal_to_the_budget_gives_the_same_run_and_a_tighter_one_evicts_more(tmp_path, warm):
    S.constant(10).save(tmp_path / "constant.json")
    S.piecewise([0, 12], [6, 8]).save(tmp_path / "tight.json")
    argv = ["--steps", "2", "--eval-every", "2", "--bin-size", "4"]
    _, _, fixed = run_in(tmp_path / "fixed", warm, *argv)
    _, _, same = run_in(tmp_path / "same", warm, *argv, "--schedule", str(tmp_path / "constant.json"))
    _, _, tight = run_in(tmp_path / "tight", warm, *argv, "--schedule", str(tmp_path / "tight.json"))
    assert untimed(same) == untimed(fixed)
    for line in fixed + tight:                                        # the per-bin metrics cover every token
        assert sum(line["tokens_by_bin"]) == line["tokens"] and len(line["alpha_p05_by_bin"]) == len(line["tokens_by_bin"])
    assert tight[0]["budget_by_bin"][:4] == [6, 6, 6, 8] and fixed[0]["budget_by_bin"][0] == 10
    assert all(t["peak_kv_bytes"] < f["peak_kv_bytes"] for t, f in zip(tight, fixed))


def test_dense_grpo_raises_the_reward(tmp_path, warm):
    # 80 warm-up steps leave the sampled reward near 0.3: room to learn. Measured: 0.30 -> 0.41 (first and last 20 steps).
    _, _, lines = run_in(tmp_path, warm, "--policy", "full", "--steps", "60", "--prompts", "8", "--group-size", "8",
                         "--lr", "5e-5", "--eval-every", "60")
    mean = lambda ls: sum(l["reward"] for l in ls) / len(ls)
    assert mean(lines[-20:]) > mean(lines[:20]) + 0.05, (mean(lines[:20]), mean(lines[-20:]))


# train.py's own refusals (resume, the caches it builds, the model, the schedule); check_args': tests/test_cli.py
@pytest.mark.parametrize("argv, message", [
    (["--resume"], "--resume: no checkpoint step-NNNNNN in"),
    (["--steps", "0", "--eval-policies", "blocktopk", "--eval-budgets", "2"],
     "the evaluation cache blocktopk at budget 2: budget=2 must be >= page_size = 4"),
    (["--model", "./no/such/folder"], "model './no/such/folder' is neither an existing folder, a GGUF file"),
    (["--model", "no/such.gguf"], "GGUF file 'no/such.gguf' does not exist"),
    (["--budget", "3", "--window", "2", "--sink", "2"], "budget=3 must be >= window \\+ sink"),
    (["--steps", "0", "--eval-budgets", "0"], "budget must be a positive integer, got 0"),
    (["--schedule", "no-such.json"], "cannot read a schedule from no-such.json"),
    (["--max-new-tokens", "102"], "max_new_tokens \\(--max-new-tokens\\) 102: the longest prompt \\(27 tokens\\) plus "
     "the response must fit "
                                  "the model's 128 positions, so at most 101"),   # checked before the toy's warm-up
])
def test_bad_input_is_one_clear_line_before_training(tmp_path, argv, message):
    with pytest.raises(SystemExit, match=message) as exit_info:
        train.main(argv + ["--out", str(tmp_path / "run")])
    assert str(exit_info.value).startswith("error: ") and "\n" not in str(exit_info.value)
    assert not (tmp_path / "run").exists()                            # nothing trained, no empty --out left


def test_a_failed_load_removes_every_folder_of_out_it_made_and_no_other(tmp_path):
    (tmp_path / "kept").mkdir()
    for out in (tmp_path / "a" / "b" / "run", tmp_path / "kept" / "run"):
        with pytest.raises(SystemExit, match="holds no config.json"):
            train.main(["--model", str(tmp_path / "kept"), "--out", str(out)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"] and not any((tmp_path / "kept").iterdir())


def test_a_cached_warm_up_still_refuses_a_response_past_the_positions(tmp_path, warm):
    # Pins main's check_length after loading: with the warm-up cached, load_model's own check never runs, so
    # without main's the run would reach the sampler and end in its ValueError traceback, not one line
    shutil.copytree(warm, tmp_path / "warmup")
    with pytest.raises(SystemExit, match="^error: max_new_tokens \\(--max-new-tokens\\) 200: the longest prompt .* "
                                         "so at most "):
        train.main(SMALL + ["--out", str(tmp_path), "--max-new-tokens", "200"])
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("flags, message", [
    (["--policy", "blocktopk", "--dense-layers", "2"], "^error: --dense-layers 2: the model has 2 layers"),
    (["--budget", "40"], "^error: --budget 40: the longest rollout holds at most")])
def test_a_flag_the_toy_model_cannot_honour_is_refused_before_its_warm_up(tmp_path, monkeypatch, flags, message):
    # on a fresh --out these were refused after the warm-up had run (~40 s), by main's check_fits
    monkeypatch.setattr(train, "warm_up", lambda *a, **k: pytest.fail("warmed up first"))
    with pytest.raises(SystemExit, match=message):
        train.main(SMALL + ["--out", str(tmp_path / "run")] + flags)


@pytest.mark.parametrize("name, text, message", [
    ("bad.jsonl", '{"question": "1+1?", "answer": "#### 2"}\n{"question": oops}\n', "bad.jsonl.*line 2"),
    ("small.jsonl", "".join('{"question": "1+%d?", "answer": "#### %d"}\n' % (i, i + 1) for i in range(10)),
     "leaves 0 training examples after the 256 held out")], ids=["malformed", "smaller-than-the-held-out-split"])
def test_a_malformed_or_too_small_data_file_is_refused(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(SystemExit, match=message):
        train.main(["--data", str(tmp_path / name), "--model", str(tmp_path), "--out", str(tmp_path / "run")])


# ----------------------------------------------------------------------------- the wiring of one step

def spy(monkeypatch, owner, name):
    """Record every call of owner.name, which still runs: -> the list of (args, kwargs, output) it fills."""
    calls, real = [], getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a, **k: calls.append((a, k, real(*a, **k))) or calls[-1][2])
    return calls


EXAMPLES = make_examples("sort", 4, 5, 4, 8)                         # SMALL's 4 prompts of 4-8 digits


def small_step(model, tokenizer, args, opt=None, step=3, ref=None, reward=reward_fn("sort")):
    """train.rl_step on EXAMPLES; by default with SGD at lr 0, which leaves the weights as they are."""
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.0)
    return train.rl_step(model, ref, opt, tokenizer, EXAMPLES, reward, train.sparse_config(args), args, step)


def test_each_phase_is_timed_on_the_synchronised_clock_after_its_work(monkeypatch, warm):
    # on a GPU an unsynchronised clock times kernel launches: the AdamW step would land in the next phase. So each
    # boundary reads sampler.clock on the model's device, after its phase's last call: a clock that ticks once a
    # read, and records what had run before each read, gives each phase 1 s and the calls in their order
    done, ticks = [], iter(range(100))
    for name in ("generate", "update"):
        real = getattr(train, name)
        monkeypatch.setattr(train, name, lambda *a, _real=real, _name=name, **k: done.append(_name) or _real(*a, **k))
    read = []
    monkeypatch.setattr(train, "clock", lambda device: read.append((str(device), list(done))) or float(next(ticks)))
    args = train.parse_args(SMALL)
    model, tokenizer = models.load_pretrained(str(warm))
    metrics = small_step(model, tokenizer, args)
    assert (metrics["rollout_s"], metrics["scoring_s"], metrics["update_s"]) == (1.0, 1.0, 1.0)
    assert read == [("cpu", []), ("cpu", ["generate"]), ("cpu", ["generate"]), ("cpu", ["generate", "update"])]


@pytest.fixture
def spied_step(monkeypatch, warm):
    """One rl_step of the small warm model with every correction call recorded -> (calls, rollouts, reference
    log-probs of the sampled tokens from a plain forward pass of each row, AdamW steps taken)."""
    from reference import full_forward_logprobs

    calls = {name: spy(monkeypatch, train.C, name)
             for name in ("rejection_mask", "importance_weights", "policy_loss", "group_advantages")}
    sampled = spy(monkeypatch, train, "generate")
    args = train.parse_args(SMALL + ["--ppo-epochs", "2", "--minibatch", "8"])
    model, tokenizer = models.load_pretrained(str(warm))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    steps = spy(monkeypatch, opt, "step")
    model_copy = copy.deepcopy(model)                                 # the weights before the update: pi_old
    small_step(model, tokenizer, args, opt, step=7)
    rollouts = sampled[0][2]
    reference = torch.zeros_like(rollouts.logprobs)
    for i, prompt in enumerate(rollouts.prompts):
        n = int(rollouts.mask[i].sum())
        reference[i, :n] = full_forward_logprobs(model_copy, prompt, rollouts.tokens[i, :n].tolist())
    return calls, rollouts, reference, steps


def test_rl_step_hands_each_correction_the_right_tensors(spied_step):
    calls, rollouts, dense, _ = spied_step
    (log_rho, mask, *_), _, (new_mask, _) = calls["rejection_mask"][0]
    real = rollouts.mask > 0
    # log rho = log pi_old - log pi_sparse, with pi_old the dense re-scoring: not the other sign
    assert torch.allclose(log_rho[real], (dense - rollouts.logprobs)[real], atol=1e-4)
    assert (log_rho[real] != 0).any()                                 # eviction made the two differ
    assert torch.equal(mask, rollouts.mask)
    # the weights are normalised over the ORIGINAL response mask, not the one rejection left
    (w_log_rho, w_mask, *_), _, weights = calls["importance_weights"][0]
    assert torch.equal(w_log_rho, log_rho) and torch.equal(w_mask, rollouts.mask)
    assert not torch.equal(new_mask, rollouts.mask)                   # rejection did drop something
    # the loss sees pi_old = the dense re-scoring (not the sampler's log-probs), the rejected mask and the weights
    (rewards, *_), _, (advantages, _) = calls["group_advantages"][0]
    for (logp, logp_old, adv, loss_mask, loss_weights, *_), kwargs, _ in calls["policy_loss"]:
        rows = [next(i for i in range(len(dense)) if torch.equal(loss_mask[j], new_mask[i]) and
                     torch.allclose(logp_old[j], dense[i], atol=1e-4)) for j in range(len(logp_old))]
        assert torch.allclose(logp_old, dense[rows], atol=1e-4)
        assert torch.equal(loss_weights, weights[rows]) and torch.equal(adv, advantages[rows])


def test_rl_step_takes_one_adamw_step_per_minibatch_and_reshuffles_every_epoch(spied_step):
    calls, rollouts, _, steps = spied_step
    assert len(steps) == 2 * len(rollouts) // 8                      # 2 epochs of 16 rollouts in minibatches of 8
    batches = [kwargs.get("logp_old", args[1]) for args, kwargs, _ in calls["policy_loss"]]
    first, second = torch.cat(batches[:2]), torch.cat(batches[2:])
    assert not torch.equal(first, second)                            # another order in the second epoch


def test_by_default_a_batch_is_one_optimizer_step_whatever_the_micro_batch(warm, monkeypatch):
    # one step on all 16 rollouts, computed 3 rows at a time, equals the step computed at once (SGD at lr 1
    # and no clipping, so the weights move by the gradient itself: a micro-batch weighed wrongly would show)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *args, **kwargs: None)
    args = train.parse_args(SMALL)
    moved = []
    for micro in (3, 64):
        model, tokenizer = models.load_pretrained(str(warm))
        before = torch.cat([p.detach().flatten() for p in model.parameters()])
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        steps = spy(monkeypatch, opt, "step")
        args.micro_batch = micro
        small_step(model, tokenizer, args, opt)
        moved.append(torch.cat([p.detach().flatten() for p in model.parameters()]) - before)
        assert len(steps) == 1
    assert moved[0].abs().max() > 1e-4 and torch.allclose(moved[0], moved[1], atol=1e-6)


def test_step_seeds_never_meet_and_another_seed_gives_other_prompts():
    args, other = train.parse_args(SMALL), train.parse_args(SMALL + ["--seed", "1"])
    assert len({train.step_seed(train.parse_args(["--seed", str(s)]), t) for s in range(4) for t in range(1, 1001)}) == 4000
    data = [dict(prompt=str(i), answer=str(i)) for i in range(100)]   # toy and --data: another --seed, other prompts
    for train_data in (None, data):
        assert train.step_examples(args, train_data, 3) != train.step_examples(other, train_data, 3)


def test_no_held_out_prompt_is_a_training_prompt():
    # seeded with -1 - seed, seed 0's held-out set began with step 1's 8 prompts: random.Random(-1) is Random(1)
    args = train.parse_args([])                                        # the quick start's run, seed 0
    _, held_out = train.load_data(args)
    trained = {e["prompt"] for t in range(1, args.steps + 1) for e in train.step_examples(args, None, t)}
    assert not {e["prompt"] for e in held_out} & trained


def test_a_step_samples_and_down_samples_from_its_step_seed_and_no_std_only_centres(warm, monkeypatch):
    # the sampler's seed and PODS's generator come from step_seed(seed, step), not from the step alone;
    # --no-std (Dr. GRPO) hands the loss r - mean(group), by hand
    sampled, centred, draws = spy(monkeypatch, train, "generate"), spy(monkeypatch, train.C, "group_advantages"), []

    def lowest_and_highest(rewards, n, m, how, generator):   # kept pairs that differ: else every advantage is 0
        draws.append(generator.initial_seed())
        groups, first = rewards.view(-1, n), torch.arange(0, len(rewards), n)
        return torch.stack([first + groups.argmin(-1), first + groups.argmax(-1)], -1).flatten()

    monkeypatch.setattr(train.C, "downsample", lowest_and_highest)
    args = train.parse_args(SMALL + ["--seed", "2", "--keep", "2", "--downsample", "random", "--no-std"])
    model, tokenizer = models.load_pretrained(str(warm))
    small_step(model, tokenizer, args)
    assert sampled[-1][1]["seed"] == draws[-1] == 2 * 100_003 + 3
    (rewards, _), _, (advantages, _) = centred[-1]
    r = rewards.view(-1, 2)
    assert (r[:, 0] != r[:, 1]).any(), "no kept pair differs: centred and scaled advantages would be equal (0)"
    assert torch.allclose(advantages, (r - r.mean(-1, keepdim=True)).flatten())


def test_the_controller_takes_the_runs_cache_settings():
    args = train.parse_args(["--controller", "0.9", "--policy", "blocktopk", "--budget", "64", "--interval", "16",
                             "--page-size", "8", "--bin-size", "32"])
    c = train.sparse_config(args, longest_prompt=10).schedule
    assert (c.threshold, c.step, c.interval, c.page_size, c.bin_size, c.budgets[0]) == (0.9, 8, 16, 8, 32, 64)
    assert c.low == 8                      # the cache's smallest budget: blocktopk's one page (8), not 1


def test_random_down_sampling_is_a_function_of_seed_and_step(warm, monkeypatch):
    kept = spy(monkeypatch, train.C, "downsample")
    args = train.parse_args(SMALL + ["--keep", "2", "--downsample", "random"])
    model, tokenizer = models.load_pretrained(str(warm))
    for global_seed in (0, 1):                                      # the global RNG must not matter
        torch.manual_seed(global_seed)
        small_step(model, tokenizer, args)
    assert torch.equal(kept[0][2], kept[1][2])


def test_resume_survives_a_half_written_line_and_reads_state_with_weights_only(tmp_path, warm, capsys):
    run_in(tmp_path, warm, "--steps", "2", "--save-every", "2", "--eval-every", "2")
    torch.load(tmp_path / "step-000002" / "trainer_state.pt", weights_only=True)   # no pickled objects
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward": 0.')                          # killed in the middle of step 3's line
    _, _, lines = run_in(tmp_path, warm, "--steps", "3", "--save-every", "1", "--eval-every", "3", "--resume",
                         "--lr", "3e-5")
    assert [l["step"] for l in lines] == [1, 2, 3]
    assert lines[1]["lr"] == 1e-5 and lines[2]["lr"] == 3e-5          # the --lr given on resume holds
    run_in(tmp_path, warm, "--steps", "3", "--eval-every", "3", "--resume")   # resumed at its end: the final
    assert (tmp_path / "eval.jsonl").read_text().count('"step": 3,') == 1     # evaluation is rerun, not repeated
    final = json.loads((tmp_path / "eval.jsonl").read_text().splitlines()[-1])
    capsys.readouterr()
    _, results = train.main(SMALL + ["--out", str(tmp_path), "--resume", "--steps", "0", "--lr", "2e-5",
                                     "--eval-budgets", "8", "--window", "3"])
    assert results["dense"] == final["dense"]                          # step 3's weights, as its final evaluation
    said = [l for l in capsys.readouterr().out.splitlines() if l.startswith(("resuming with", "learning rate"))]
    assert said == ["resuming with a setting of its own: --window 2 there, 3 here"]   # not --lr, --steps, --eval-*
    for argv, message in ((["--steps", "2"], "--steps 2 ends before step-000003"),
                          (["--task", "pick"], "--task 'sort' there, 'pick' here"),
                          (["--seed", "3"], "made by another run \\(--seed 0 there, 3 here\\)"),
                          (["--warmup-steps", "5"], "--warmup-steps 80 there, 5 here")):
        with pytest.raises(SystemExit, match=message):                  # one line, before any model loads
            train.main(SMALL + ["--out", str(tmp_path), "--resume", *argv])
    run_in(tmp_path, warm, "--steps", "1", "--eval-every", "1")        # fresh in the same folder: no old line kept,
    evals = [json.loads(l)["step"] for l in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert evals == [0, 1] and sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000001"]   # the end once
    kept = tmp_path / "previous-1"                                     # the earlier run, set aside whole
    assert (kept / "step-000003").is_dir() and len((kept / "metrics.jsonl").read_text().splitlines()) == 3
    run_in(tmp_path, warm, "--steps", "1", "--eval-every", "1")         # and again: the first stays, numbered
    assert (kept / "step-000003").is_dir() and (tmp_path / "previous-2" / "step-000001").is_dir()


def saved_run(out, *argv, base=SMALL):
    """A checkpoint folder out/step-000002 as train.py writes it (args.json, config.json, trainer_state.pt), with no
    weights: enough for --resume's checks, which come before any model loads."""
    (out / "step-000002").mkdir(parents=True)
    args = train.parse_args(base + ["--out", str(out), "--steps", "2", *argv])
    (out / "step-000002" / "args.json").write_text(json.dumps(vars(args)))
    (out / "step-000002" / "config.json").write_text("{}")
    torch.save(dict(step=2), out / "step-000002" / "trainer_state.pt")


@pytest.mark.parametrize("flag, there, here", [
    ("--policy", "'snapkv'", "'h2o'"), ("--budget", "10", "8"), ("--interval", "2", "3"), ("--window", "2", "3"),
    ("--sink", "2", "1"), ("--correction", "'sparse-rl'", "'none'"), ("--group-size", "4", "2"),
    ("--keep", "4", "2"), ("--max-new-tokens", "10", "12"), ("--temperature", "1.0", "0.7"), ("--eval-size", "32", "16"),
    ("--distill", "'off'", "'kl'"), ("--bin-size", "16", "8"), ("--kl", "0.0", "0.1"), ("--reward", "'task'", "'exact'"),
    ("--controller", "None", "0.9")])
def test_resume_refuses_a_flag_that_changes_the_steps_before_any_model_loads(tmp_path, monkeypatch, flag, there, here):
    """Was: each of these printed one line and trained on, so metrics.jsonl and the summary mixed two caches (or
    corrections, groups, held-out sets). The error names the flag, its saved value and the new one."""
    saved_run(tmp_path)
    monkeypatch.setattr(train, "load_model", lambda *a: pytest.fail("a model loaded"))
    message = f"^error: --resume: .*step-000002 was made by another run \\({flag} {there} there, {here} here[;)]"
    with pytest.raises(SystemExit, match=message):
        train.main(SMALL + ["--out", str(tmp_path), "--steps", "4", "--resume", flag, here.strip("'")])


def test_resume_may_change_how_long_how_often_where_and_the_lr_and_evaluate_under_any_cache(tmp_path, capsys):
    saved_run(tmp_path)
    argv = ["--steps", "9", "--eval-every", "3", "--save-every", "3", "--lr", "3e-5", "--lora-lr-scale", "2",
            "--micro-batch", "1", "--captured", "--device", "cpu", "--threads", "1", "--dtype", "bfloat16"]
    args = train.parse_args(SMALL + ["--out", str(tmp_path), "--resume", *argv])
    assert cli.resume_point(args, tmp_path).name == "step-000002"
    said = [l for l in capsys.readouterr().out.splitlines() if l.startswith("resuming with")]
    assert len(said) == 10 and "resuming with a setting of its own: --lr 1e-05 there, 3e-05 here" in said
    # evaluate only (--steps 0): another cache is the point; the run's own settings still hold
    args = train.parse_args(SMALL + ["--out", str(tmp_path), "--resume", "--steps", "0", "--policy", "h2o", "--budget", "8"])
    assert cli.resume_point(args, tmp_path).name == "step-000002"
    args = train.parse_args(SMALL + ["--out", str(tmp_path), "--resume", "--steps", "0", "--seed", "1"])
    with pytest.raises(ValueError, match="--seed 0 there, 1 here\\); pass its settings, or another --out$"):
        cli.resume_point(args, tmp_path)


def test_resume_on_another_device_names_the_preset_that_chose_the_refused_values(tmp_path):
    """--model smollm2-135m --device cuda trains 16 x 8 rollouts (cli.GPU); resumed with --device cpu it would
    take 2 x 4 (cli.ARITHMETIC): the refusal lists flags the user never typed, so it says where they came from."""
    saved_run(tmp_path, base=["--model", "smollm2-135m", "--device", "cuda"])
    here = train.parse_args(["--model", "smollm2-135m", "--device", "cpu", "--out", str(tmp_path), "--resume"])
    with pytest.raises(ValueError, match="--prompts 16 there, 2 here.*; smollm2-135m's defaults depend on --device "
                                         "\\(cli.preset\\): resume with --device cuda, or another --out$"):
        cli.resume_point(here, tmp_path)
    # a toy run has no such preset: no such sentence
    saved_run(tmp_path / "toy")
    toy = train.parse_args(SMALL + ["--out", str(tmp_path / "toy"), "--resume", "--steps", "4", "--group-size", "2"])
    toy.device = "cuda"
    with pytest.raises(ValueError, match="--group-size 4 there, 2 here") as refused:
        cli.resume_point(toy, tmp_path / "toy")
    assert "cli.preset" not in str(refused.value)


def test_an_out_that_is_a_file_is_one_clear_line(tmp_path):
    (tmp_path / "afile").write_text("")
    for out in (tmp_path / "afile", tmp_path / "afile" / "sub" / "run"):      # itself, or a folder it would go in
        message = f"error: --out '{out}': '{tmp_path / 'afile'}' is a file, not a folder"
        with pytest.raises(SystemExit, match=f"^{re.escape(message)}$"):
            train.main(["--out", str(out)])
    if os.path.isdir("/proc/self"):                                    # a folder no one can make (Linux)
        with pytest.raises(SystemExit, match="^error: --out '/proc/x/y': cannot make that folder "):   # was errno's line
            train.main(["--out", "/proc/x/y"])


def test_a_damaged_checkpoint_is_one_clear_line_naming_it(tmp_path, warm):
    # each was a traceback (a list in args.json: silently no check of the run); the torn files came after the load
    run_in(tmp_path / "run", warm, "--steps", "1")
    damages = [("args.json", "{bad", "cannot read .*args.json \\(Expecting property name"),
               ("args.json", "[1]", "args.json holds a list, not a run's settings"),
               ("args.json", None, "cannot read .*args.json \\(\\[Errno 2\\]"),
               ("trainer_state.pt", None, "step-000001 holds no trainer_state.pt: a damaged checkpoint: remove"),
               ("trainer_state.pt", "torn", "step-000001/trainer_state.pt is no trainer state \\("),
               ("model.safetensors", None, "cannot load the weights of .*step-000001 \\(Error no file named")]
    for i, (name, text, message) in enumerate(damages):
        shutil.copytree(tmp_path / "run", tmp_path / str(i))
        (tmp_path / str(i) / "step-000001" / name).unlink()
        if text is not None:
            (tmp_path / str(i) / "step-000001" / name).write_text(text)
        with pytest.raises(SystemExit, match=message) as exit_info:
            train.main(SMALL + ["--out", str(tmp_path / str(i)), "--steps", "2", "--resume"])
        assert str(exit_info.value).startswith("error: ") and "\n" not in str(exit_info.value)


def test_steps_0_evaluates_the_warm_up_dense_and_under_each_cache(tmp_path, warm, capsys):
    if not (tmp_path / "warmup").exists():
        shutil.copytree(warm, tmp_path / "warmup")
    _, results = train.main(SMALL + ["--out", str(tmp_path), "--steps", "0", "--eval-policies", "snapkv", "streaming",
                                     "--eval-budgets", "6", "10"])
    assert list(results) == ["dense", "snapkv, budget 6", "snapkv, budget 10", "streaming, budget 6",
                             "streaming, budget 10"]
    model, tokenizer = models.load_pretrained(str(warm))              # the same numbers, computed directly
    args = train.parse_args(SMALL)
    _, held_out = train.load_data(args)
    streaming = train.sparse_config(args, "streaming", 6)
    expect = accuracy(eval_rewards(model, tokenizer, held_out, reward_fn("sort"), streaming, args.max_new_tokens))
    assert results["streaming, budget 6"] == expect
    # every row, against caches built by hand from SMALL's flags and the toy's (interval 2, window 2, sink 2),
    # not by train.sparse_config (the reference above is the code's own): a mutant whose evaluation caches lost
    # --interval (SparseConfig's 128: no eviction in 10 new tokens, every row the dense one's) passed
    by_hand = {"dense": SparseConfig("full")} | {f"{p}, budget {b}": SparseConfig(p, b, interval=2, window=2, sink=2)
                                                 for p in ("snapkv", "streaming") for b in (6, 10)}
    expect = {name: accuracy(eval_rewards(model, tokenizer, held_out, reward_fn("sort"), c, 10))
              for name, c in by_hand.items()}
    assert results == expect and len(set(expect.values())) > 2
    assert "| snapkv, budget 10 |" in capsys.readouterr().out
    assert not (tmp_path / "metrics.jsonl").exists() and not list(tmp_path.glob("step-*"))


def test_a_warm_up_made_with_other_settings_is_made_anew(tmp_path, warm, capsys, monkeypatch):
    shutil.copytree(warm, tmp_path / "warmup")
    args = train.parse_args(SMALL + ["--out", str(tmp_path), "--lr", "1e-3", "--policy", "h2o"])
    train.load_model(args, torch.device("cpu"))         # RL settings differ: shared
    assert "making a new warm-up" not in capsys.readouterr().out
    with monkeypatch.context() as m:                    # another seed alone: another warm-up (not trained here)
        m.setattr(train, "warm_up", lambda *a, **k: None)
        shutil.copytree(warm, tmp_path / "s1" / "warmup")
        train.load_model(train.parse_args(SMALL + ["--out", str(tmp_path / "s1"), "--seed", "1"]), torch.device("cpu"))
    assert "making a new warm-up" in capsys.readouterr().out
    args = train.parse_args(SMALL + ["--out", str(tmp_path), "--task", "reverse", "--warmup-steps", "2"])
    model, _ = train.load_model(args, torch.device("cpu"))
    assert "making a new warm-up" in capsys.readouterr().out
    made = json.loads((tmp_path / "warmup" / "warmup.json").read_text())
    assert made["task"] == "reverse" and made["warmup_steps"] == 2


def test_controller_bins_cover_the_prompt_and_the_response():
    # SmolLM2 on its arithmetic data: prompts of 173-175 tokens, 128 new tokens, bins of 64. Contexts run from
    # 173 to 175 + 127 = 302, so the bins are 0, 64, ..., 256 (5); sized from the 128 new tokens alone (3 bins)
    # every token fell in the last one.
    args = train.parse_args(["--controller", "0.86", "--bin-size", "64", "--max-new-tokens", "128", "--budget", "128"])
    assert train.sparse_config(args, longest_prompt=175).schedule.bins == (0, 64, 128, 192, 256)


def test_a_schedule_or_controller_takes_budgets_a_fixed_cache_would_refuse(tmp_path):
    # block top-k needs budgets of at least a page (the toy's: 4); a --budget of 3 would fail, but a schedule's
    # budgets replace it: they are checked, and a schedule with a budget under a page is refused
    pages = ["--policy", "blocktopk", "--budget", "3", "--schedule"]
    S.piecewise([0, 16], [4, 8]).save(tmp_path / "pages.json")
    assert train.sparse_config(train.parse_args(pages + [str(tmp_path / "pages.json")])).schedule.budgets == (4, 8)
    S.piecewise([0, 16], [2, 8]).save(tmp_path / "short.json")
    with pytest.raises(ValueError, match="^budget=2 must be >= page_size = 4$"):   # the run's cache: no evaluation's
        train.sparse_config(train.parse_args(pages + [str(tmp_path / "short.json")]))
    # the controller starts at --budget, even above its usual cap (controller.HIGH), and never goes past it
    args = train.parse_args(["--controller", "0.86", "--budget", str(HIGH + 904)])
    controller = train.sparse_config(args).schedule
    assert set(controller.budgets) == {HIGH + 904} and controller.high == HIGH + 904


def test_an_evaluation_cache_is_fixed_whatever_schedule_or_controller_the_run_has(tmp_path):
    # Pins sparse_config(args, policy, budget): that policy at that budget, no schedule, even where args carry a
    # --schedule or a --controller (their budgets are the run's rollouts', not an evaluation's)
    S.piecewise([0, 16], [8, 12]).save(tmp_path / "s.json")
    for flags in (["--schedule", str(tmp_path / "s.json")], ["--controller", "0.86"]):
        sparse = train.sparse_config(train.parse_args(flags), "streaming", 6)
        assert (sparse.policy, sparse.budget, sparse.schedule) == ("streaming", 6, None)


def test_the_longest_toy_prompt_by_brute_force():
    # pick with 6 digits: bos + "P" + 6 digits + up to 18 letters + "=" = 27 tokens; sort 4-8 digits: 1 + 1 + 8 + 1
    tok = char_tokenizer()
    for task, digits in (("pick", [3, 6]), ("sort", [4, 8])):
        args = train.parse_args(["--task", task, "--digits", *map(str, digits)])
        seen = max(len(encode_prompt(tok, e["prompt"])) for e in make_examples(task, 3000, 1, *digits))
        assert train.longest_prompt(args, None, None, tok) == seen == {"pick": 27, "sort": 11}[task]
    # a --data run: the longest of its training and held-out prompts, by brute force over both (here a held-out
    # one, 9 digits; the training ones hold 2-6). Mutant caught: the training prompts alone (longest 9, not 12)
    data = ([dict(prompt="S" + "7" * n + "=", answer="") for n in (2, 6, 4)],
            [dict(prompt="S" + "3" * 9 + "=", answer="")])
    seen = max(len(encode_prompt(tok, e["prompt"])) for e in data[0] + data[1])
    assert train.longest_prompt(train.parse_args([]), *data, tok) == seen == 12


def test_training_and_calibration_measure_alpha_with_one_k(monkeypatch):
    # the 0.86 threshold is held in training and in calibration: both must sum alpha over the same top-k
    model = models.toy_model(char_tokenizer())
    calibrated, trained = spy(monkeypatch, S, "generate"), spy(monkeypatch, train, "generate")
    S.measure(model, [[1, 5, 6]], SparseConfig("snapkv", budget=8, interval=2, window=2, sink=2), 4)
    small_step(model, char_tokenizer(), train.parse_args(SMALL), torch.optim.AdamW(model.parameters(), lr=1e-5), 1)
    assert ALPHA_TOPK == 64 and model.config.vocab_size == 34
    seen = [out.topk_ids.shape[-1] for _, _, out in calibrated + trained]     # the k the rollouts carry
    assert seen == [34, 34]                                           # min(64, V): the whole toy vocabulary


def test_threads_by_model_size():
    assert train.threads(train.parse_args([])) == 1                                  # the toy model
    assert train.threads(train.parse_args(["--threads", "3"])) == 3
    assert train.threads(train.parse_args(["--model", "org/name"])) == torch.get_num_threads()


def test_bf16_moves_the_weights_as_fp32_does_and_saves_a_plain_checkpoint(tmp_path, warm):
    # two AdamW steps at lr 1e-6: fp32 weights take steps of ~1e-6 (Adam normalises the gradient); weights stored
    # in bf16 (8 bits of mantissa: a step below ~half a unit in the last place rounds away) would barely move.
    # --dtype bfloat16 keeps fp32 weights and runs the forwards under autocast: the same share must move.
    start = AutoModelForCausalLM.from_pretrained(warm)
    moved = {}
    for dtype in ("float32", "bfloat16"):
        model, _, _ = run_in(tmp_path / dtype, warm, "--steps", "2", "--lr", "1e-6", "--dtype", dtype,
                             "--eval-every", "1000", "--eval-size", "8")
        assert all(p.dtype == torch.float32 for p in model.parameters())
        changed = sum(int((p.detach() != q).sum()) for p, q in zip(model.parameters(), start.parameters()))
        moved[dtype] = changed / sum(p.numel() for p in start.parameters())
        saved = AutoModelForCausalLM.from_pretrained(tmp_path / dtype / "step-000002")     # plain transformers
        torch.testing.assert_close(saved.state_dict(), model.state_dict(), atol=0, rtol=0)
    assert moved["float32"] > 0.5                                         # nearly every weight with a gradient
    assert moved["float32"] / 2 <= moved["bfloat16"] <= moved["float32"] * 2


def test_captured_training_equals_eager_training(tmp_path, warm):
    # --captured decodes with static.py's static-shape step (on a CPU: the same step, not captured): the same
    # rollouts, so the same rewards, losses and mismatch, step by step
    lines = [run_in(tmp_path / name, warm, "--steps", "2", "--eval-every", "1000", "--eval-size", "8", *extra)[2]
             for name, extra in (("eager", []), ("captured", ["--captured"]))]
    for eager, captured in zip(*lines):
        for key in ("reward", "loss", "rho_mean", "alpha_p05", "dropped_tokens", "peak_kv_bytes"):
            assert captured[key] == pytest.approx(eager[key], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("correction", ["sparse-rl", "tis", "none"])
def test_rl_step_gives_the_loss_what_the_flags_say_against_a_plain_recomputation(warm, monkeypatch, correction):
    """One rl_step with PODS (keep 2 of 4 per prompt), temperature 0.8, clip 0.3, KL 0.05 to another model,
    token-mean, micro-batches of 3 and a band, veto and cap of their own, against a plain recomputation:
    row i answers prompt i // 4; the pairs kept have the largest variance (brute force) and their advantages
    are +-|a - b| / 2 / (|a - b| / sqrt 2 + 1e-4); rho = pi_old / pi_sparse from one plain forward pass per
    row; rejection, weights and the loss at r = 1 (L_t = -w_t A + 0.05 k3_t over the sampled tokens) by hand.
    16 rows sampled [16, T], 8 trained on, in 3 micro-batches."""
    from itertools import combinations
    from reference import full_forward_logprobs

    calls, sampled, norms = spy(monkeypatch, train.C, "policy_loss"), spy(monkeypatch, train, "generate"), []
    real_clip = torch.nn.utils.clip_grad_norm_

    def clip_spy(params, max_norm, *a, **k):
        params = list(params)
        out = real_clip(params, max_norm, *a, **k)
        norms.append((float(out), float(torch.cat([p.grad.flatten() for p in params]).norm())))
        return out
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip_spy)
    args = train.parse_args(SMALL + ["--keep", "2", "--temperature", "0.8", "--clip", "0.3", "--kl", "0.05",
                                     "--agg", "token-mean", "--micro-batch", "3", "--band", "0.7", "1.3",
                                     "--veto", "0.01", "--cap", "1.2", "--correction", correction])
    model, tokenizer = models.load_pretrained(str(warm))
    pi_old, ref = copy.deepcopy(model), models.toy_model(tokenizer)   # ref: random weights, another policy
    credit = lambda text, answer: sum(a == b for a, b in zip(text, answer)) / len(answer)   # partial credit
    metrics = small_step(model, tokenizer, args, torch.optim.AdamW(model.parameters(), lr=1e-5), ref=ref,
                         reward=credit)
    rollouts, T, examples = sampled[0][2], 0.8, EXAMPLES
    lengths = rollouts.mask.sum(-1).long().tolist()
    rewards, old, logp_ref = [], torch.zeros_like(rollouts.logprobs), torch.zeros_like(rollouts.logprobs)
    for i, n in enumerate(lengths):                                    # consecutive groups of 4
        assert rollouts.prompts[i] == encode_prompt(tokenizer, examples[i // 4]["prompt"])
        response = rollouts.tokens[i, :n].tolist()
        rewards.append(credit(tokenizer.decode(response, skip_special_tokens=True), examples[i // 4]["answer"]))
        old[i, :n] = full_forward_logprobs(pi_old, rollouts.prompts[i], response, T)
        logp_ref[i, :n] = full_forward_logprobs(ref, rollouts.prompts[i], response, T)
    assert metrics["reward"] == pytest.approx(sum(rewards) / 16)
    assert metrics["accuracy"] == sum(r == 1 for r in rewards) / 16 < metrics["reward"]
    # the rows each micro-batch trained on, found by their pi_old; 8 in all, 2 of each group of 4
    rows = [i for a, _, _ in calls for j in range(len(a[1]))
            for i in [next(i for i in range(16) if torch.allclose(a[1][j], old[i], atol=1e-4))]]
    assert [len(a[1]) for a, _, _ in calls] == [3, 3, 2] and sorted(i // 4 for i in rows) == [0, 0, 1, 1, 2, 2, 3, 3]
    adv = {}
    for g in range(4):
        a, b = [rewards[i] for i in rows if i // 4 == g]
        assert (a - b) ** 2 == pytest.approx(max((rewards[i] - rewards[j]) ** 2
                                                 for i, j in combinations(range(4 * g, 4 * g + 4), 2)))
        for i in (i for i in rows if i // 4 == g):
            adv[i] = 0.0 if a == b else (rewards[i] - (a + b) / 2) / (abs(a - b) / 2 ** 0.5 + 1e-4)
    assert any(adv.values())
    real = rollouts.mask[rows] > 0
    rho = torch.exp(old[rows] - rollouts.logprobs[rows])
    kept = real.clone()
    if correction == "sparse-rl":
        vetoed = ((rho < 0.01) & real).any(-1)
        kept = real & (rho >= 0.7) & (rho <= 1.3) & ~vetoed[:, None]
        assert 0 < kept.sum() < real.sum()
    weights = torch.ones_like(rho) if correction == "none" else rho.clamp(max=1.2) * real
    weights = weights / (weights * real).sum() * real.sum()          # mean 1 over the 8 rows' sampled tokens
    A = torch.tensor([adv[i] for i in rows])[:, None]
    k3 = torch.exp(logp_ref[rows] - old[rows]) - 1 - (logp_ref[rows] - old[rows])
    loss = ((-weights * A + 0.05 * k3) * kept).sum() / real.sum()    # token-mean; r = 1 on the first update
    at = 0
    for (logp, logp_old, advantages, mask, w, clip), kwargs, _ in calls:
        n = len(logp)
        assert clip == 0.3 and kwargs["kl_coef"] == 0.05 and kwargs["agg"] == "token-mean"
        assert torch.allclose(logp * real[at:at + n], old[rows[at:at + n]], atol=1e-4)    # pi_theta = pi_old
        assert torch.allclose(advantages, A[at:at + n, 0].to(advantages.dtype), atol=1e-5)
        assert torch.equal(mask > 0, kept[at:at + n]) and torch.equal(kwargs["response_mask"] > 0, real[at:at + n])
        assert torch.allclose(w * real[at:at + n], weights[at:at + n] * real[at:at + n], atol=1e-4)
        assert torch.allclose(kwargs["logp_ref"], logp_ref[rows[at:at + n]], atol=1e-4)
        at += n
    assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-4, abs=1e-6)
    assert metrics["mean_weight"] == pytest.approx(((weights * kept).sum() / kept.sum()).item(), rel=1e-4)
    # The step's mismatch metrics, written to metrics.jsonl (test_a_run_writes_every_metric_and_a_loadable_checkpoint
    # only checks that their keys are there), over the 8 trained rows' sampled tokens, by hand from pi_old's plain
    # forward pass: rho = pi_old / pi_sparse, k1 = -log rho, k3 = rho - 1 - log rho; alpha = sum_v min(p_old,
    # p_sparse) over the sampler's top-k ids (the toy's 34 <= 64: the whole vocabulary) at T, pooled and per bin of
    # --bin-size (context = prompt + t); a group whose kept pair earned the same reward is a zero-std group.
    # Mutants caught: mismatch_stats handed (sparse, dense) (rho inverted), bin_metrics handed rho for alpha.
    log_rho = (old[rows] - rollouts.logprobs[rows])[real].double()
    for key, value in (("rho_mean", log_rho.exp().mean()), ("rho_min", log_rho.exp().min()),
                       ("kl_k1", (-log_rho).mean()), ("kl_k3", (log_rho.exp() - 1 - log_rho).mean())):
        assert metrics[key] == pytest.approx(value.item(), rel=1e-4, abs=1e-6), key
    alphas, contexts = [], []
    for i in rows:
        n, P = lengths[i], len(rollouts.prompts[i])
        with torch.no_grad():
            logits = pi_old(torch.tensor([rollouts.prompts[i] + rollouts.tokens[i, :n].tolist()])).logits[0]
        p_old = (logits[P - 1: P - 1 + n].double() / T).softmax(-1).gather(-1, rollouts.topk_ids[i, :n])
        alphas.append(torch.minimum(p_old, rollouts.topk_logprobs[i, :n].double().exp()).sum(-1))
        contexts += range(P, P + n)
    alphas, contexts = torch.cat(alphas), torch.tensor(contexts)
    assert rollouts.topk_ids.shape[-1] == 34 and alphas.min() < 0.999                  # the mismatch is there
    assert metrics["alpha_mean"] == pytest.approx(alphas.mean().item(), abs=1e-5)
    assert metrics["alpha_p05"] == pytest.approx(float(np.quantile(alphas.numpy(), 0.05)), abs=1e-5)
    bins = contexts // args.bin_size
    assert metrics["tokens_by_bin"] == [int((bins == b).sum()) for b in range(int(bins.max()) + 1)]
    assert metrics["alpha_p05_by_bin"] == [pytest.approx(float(np.quantile(alphas[bins == b].numpy(), 0.05)), abs=2e-4)
                                           if (bins == b).any() else None for b in range(int(bins.max()) + 1)]
    assert metrics["zero_std_groups"] == sum(len({rewards[i] for i in rows if i // 4 == g}) == 1 for g in range(4))
    (before, after), = norms                                          # one AdamW step, its gradient clipped to 1
    assert before > 1 and after == pytest.approx(1.0, rel=1e-4)


def test_restore_puts_back_every_piece_of_trainer_state(tmp_path):
    """train.restore on a hand-made checkpoint: the AdamW moments of the model and of the adapter, each at the
    command line's lr (the adapter's times --lora-lr-scale), the global RNG, the adapter's weights and the
    controller's budgets, all equal to what was saved."""
    import distill
    tok = char_tokenizer()

    def made(seed, lr):                                              # toy model + adapter after one AdamW step each
        torch.manual_seed(seed)
        model = models.toy_model(tok)
        lora = distill.LoRA(model, 2)
        opts = torch.optim.AdamW(model.parameters(), lr=lr), torch.optim.AdamW(lora.parameters(), lr=lr)
        with torch.no_grad():
            for p in lora.parameters():
                p.normal_()
        for opt, params in zip(opts, (model.parameters(), lora.parameters())):
            sum((p ** 2).sum() for p in params).backward()
            opt.step()
        return model, lora, *opts

    model, lora, opt, lora_opt = made(0, 0.1)
    lora.save(tmp_path / "adapter.safetensors")
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    args = train.parse_args(["--lr", "3e-5", "--lora-lr-scale", "4", "--controller", "0.86", "--bin-size", "16",
                             "--max-new-tokens", "12", "--budget", "12"])
    controller = train.sparse_config(args, longest_prompt=20).schedule           # bins 0, 16: 20 + 12 tokens
    budgets = [8, 11]
    state = dict(step=2, optimizer=opt.state_dict(), torch_rng=rng, budgets=budgets,
                 lora_optimizer=lora_opt.state_dict())
    _, lora2, opt2, lora_opt2 = made(1, 0.5)
    torch.manual_seed(0)
    train.restore(state, tmp_path, args, opt2, lora2, lora_opt2, controller)
    assert torch.equal(torch.get_rng_state(), rng)
    assert list(controller.budgets) == budgets
    assert [g["lr"] for g in opt2.param_groups] == [3e-5] and [g["lr"] for g in lora_opt2.param_groups] == [1.2e-4]
    for saved, loaded in ((opt, opt2), (lora_opt, lora_opt2)):
        for p, q in zip(saved.param_groups[0]["params"], loaded.param_groups[0]["params"]):
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(saved.state[p][key], loaded.state[q][key])
    assert all(torch.equal(p, q) for p, q in zip(lora.parameters(), lora2.parameters()))
    for rank in (1, 4):   # an adapter of another --lora-rank: one line naming both ranks (rank 1 would broadcast)
        with pytest.raises(SystemExit, match=f"^error: .*adapter.safetensors holds a rank-2 adapter, this one has "
                                             f"rank {rank} \\(train.py: resume with the --lora-rank it was trained with\\)$"):
            train.restore(state, tmp_path, args, opt2, distill.LoRA(model, rank), lora_opt2, controller)


def test_a_data_file_is_split_into_disjoint_training_and_held_out_examples(tmp_path):
    """With no --eval-data the last --eval-size examples are held out and never trained on (12 lines: 9 + 3)."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join('{"question": "1+%d?", "answer": "#### %d"}\n' % (i, i + 1) for i in range(12)))
    args = train.parse_args(["--model", "m", "--data", str(data), "--eval-size", "3", "--prompts", "2"])
    training, held_out = train.load_data(args)
    assert [e["answer"] for e in held_out] == ["10", "11", "12"] and len(training) == 9
    assert not {e["prompt"] for e in training} & {e["prompt"] for e in held_out}
    # with --eval-data, the whole --data trains and the first --eval-size lines of the other file are held out
    args = train.parse_args(["--model", "m", "--data", str(data), "--eval-data", str(data), "--eval-size", "3"])
    training, held_out = train.load_data(args)
    assert len(training) == 12 and [e["answer"] for e in held_out] == ["1", "2", "3"]


def test_the_summary_prints_the_numbers_of_its_history_by_hand(tmp_path, capsys):
    """train.summary on 25 hand-made steps (so that the first 20 and the last 20 differ) and a hand-made eval.jsonl:
    every number of its table and lines, worked out by hand in the comments."""
    T = S.THRESHOLD
    history = [dict(step=s, reward=s / 100, peak_kv_bytes=2048, dense_kv_bytes=8192, vetoed=int(s % 5 == 0),
                    dropped_tokens=2 if s % 2 else 4, kept_tokens=8 if s % 2 else 6, tokens=10,
                    rho_mean=1 + (s - 13) / 1000, alpha_p05=0.7 + s / 250, bin_size=16,
                    alpha_p05_by_bin=[0.9, None] if s <= 10 else [T, 0.95] if s <= 20 else [0.5, 0.9, 0.8])
               for s in range(1, 26)]
    evals = [dict(step=0, dense=0.1, sparse=0.2), dict(step=25, dense=0.75, sparse=0.5)]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    sparse = SparseConfig("snapkv", budget=12, interval=4, window=4, sink=2)
    train.summary(tmp_path, dict(dense=0.25, sparse=0.125), evals[1], history, sparse, 90.0)
    lines = capsys.readouterr().out.splitlines()
    assert "| before RL | 0.250 | 0.125 |" in lines and "| after RL  | 0.750 | 0.500 |" in lines
    assert "| accuracy (greedy, 25 steps run) | dense inference | sparse (snapkv, budget 12) |" in lines
    assert "peak KV of the sparse rollouts: 2 KiB per step, 25.0% of a full cache (8 KiB)" in lines
    # vetoed on steps 5, 10, ..., 25; dropped 13 x 2 + 12 x 4 = 74 of 250 tokens
    assert "the correction's rejection: 5 responses vetoed, 29.6% of response tokens dropped" in lines
    # steps 1-20: mean 10.5 / 100; steps 6-25: 15.5 / 100
    assert "training reward of the sparse rollouts: 0.105 over the first 20 steps, 0.155 over the last 20" in lines
    # rho: 1 + mean(s - 13) / 1000 = 1; alpha p05: 0.7 + 13 / 250
    assert "mismatch: mean rho 1.000, alpha p05 0.752 (mean over steps)" in lines
    # steps 6-25 by bin: (5 x 0.9 + 10 x 0.86 + 5 x 0.5) / 20 = 0.78; (10 x 0.95 + 5 x 0.9) / 15; 0.8 on 21-25 alone.
    # Every bin held on steps 1-20 (exactly 0.86 holds), not on 21-25
    assert (f"alpha p05 by context length, mean over the last 20 steps: 0-15: 0.780, 16-31: 0.933, 32-47: 0.800; "
            f">= {T} in every bin on 20 of 25 steps") in lines
    assert lines[-1] == f"wall time: 1.5 min; metrics in {tmp_path}/metrics.jsonl"
    # a resumed run (no first evaluation of its own) reads its "before" from eval.jsonl's first line, and names
    # the steps it ran (11-25: mean 18 / 100)
    train.summary(tmp_path, None, evals[1], history[10:], sparse, 90.0)
    lines = capsys.readouterr().out.splitlines()
    assert "| before RL | 0.100 | 0.200 |" in lines
    assert "training reward of the sparse rollouts: 0.180 over steps 11-25, 0.180 over the last 15" in lines
    # without rejection (--correction none or tis: rl_step's lines hold no kept_tokens), not "0 responses vetoed,
    # 0.0% of response tokens dropped", which reads as a rejection that found nothing to drop
    unrejected = [{k: v for k, v in m.items() if k != "kept_tokens"} | dict(vetoed=0, dropped_tokens=0)
                  for m in history]
    train.summary(tmp_path, None, evals[1], unrejected, sparse, 90.0)
    lines = capsys.readouterr().out.splitlines()
    assert "the correction's rejection: none (only --correction sparse-rl rejects)" in lines


def drawings(capsys):
    """What tqdm drew on stderr, one drawing a line: it redraws a bar after a carriage return, and a `.` of the
    patterns below would match across it, joining one drawing's count to the next one's numbers (tqdm 4.70
    draws "0/3 [...]" then, after a "\\r", "1/3 [..., reward=...]")."""
    return capsys.readouterr().err.replace("\r", "\n")


def test_the_progress_bar_shows_each_steps_numbers_beside_its_own_count(tmp_path, warm, capsys):
    # Was: set_postfix redrew the bar before its count moved on, so step 1's reward showed at "0/3", and step 2's at
    # "1/3" all through step 2's evaluation (and a checkpoint, for a real model minutes). Every bar drawn with numbers
    # must show, at count k, those of metrics.jsonl's step k.
    _, _, lines = run_in(tmp_path, warm, "--steps", "3", "--eval-every", "2", "--save-every", "1")
    drawn = re.findall(r"GRPO:.*? (\d+)/3 .*?acc=([\d.]+), dropped=([\d.]+), reward=([\d.]+)\]", drawings(capsys))
    assert drawn and {k for k, *_ in drawn} >= {"3"}
    for k, acc, dropped, reward in drawn:
        assert int(k) >= 1, f"a step's numbers drawn at count {k}: reward {reward}"
        step = lines[int(k) - 1]
        assert (acc, dropped, reward) == (f"{step['accuracy']:.2f}", f"{step['dropped_tokens'] / step['tokens']:.2f}",
                                          f"{step['reward']:.2f}")


def test_a_resumed_runs_bar_counts_on_from_its_checkpoint_beside_each_steps_numbers(tmp_path, warm, capsys):
    # Was: the bar of a run resumed at step 2 of 4 counted 1/2, 2/2, so step 4's reward showed at "2/2". At count k
    # every bar drawn must show metrics.jsonl's step k, as in a run that was never stopped
    run_in(tmp_path, warm, "--steps", "2", "--eval-every", "2", "--save-every", "2")
    capsys.readouterr()
    _, _, lines = run_in(tmp_path, warm, "--steps", "4", "--eval-every", "2", "--save-every", "2", "--resume")
    drawn = re.findall(r"GRPO:.*? (\d+)/(\d+) .*?acc=([\d.]+), dropped=([\d.]+), reward=([\d.]+)\]",
                       drawings(capsys))
    assert ("4", "4") in {(k, total) for k, total, *_ in drawn}    # tqdm may skip drawing 3/4: a fast step
    for k, total, acc, dropped, reward in drawn:
        step = lines[int(k) - 1]
        assert total == "4" and step["step"] == int(k) >= 3
        assert (acc, dropped, reward) == (f"{step['accuracy']:.2f}", f"{step['dropped_tokens'] / step['tokens']:.2f}",
                                          f"{step['reward']:.2f}")


def test_a_run_stopped_before_its_first_checkpoint_is_set_aside_not_overwritten(tmp_path, warm, monkeypatch, capsys):
    # Was: with no step-NNNNNN in --out, a fresh start truncated the earlier run's metrics.jsonl and eval.jsonl to
    # nothing (a 200-step toy run stopped at step 40 lost its 40 lines); README: the earlier run moves to previous-N
    def killed(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(train, "save_checkpoint", killed)             # Ctrl-C in the first save, at step 2
    with pytest.raises(KeyboardInterrupt):
        run_in(tmp_path, warm, "--steps", "2", "--save-every", "2", "--eval-every", "2")
    monkeypatch.undo()
    earlier = {log: (tmp_path / log).read_text() for log in ("metrics.jsonl", "eval.jsonl")}
    assert earlier["metrics.jsonl"].count("\n") == 2 and not list(tmp_path.glob("step-*"))
    capsys.readouterr()
    run_in(tmp_path, warm, "--steps", "1", "--eval-every", "1")
    assert f"the run there moves to {tmp_path / 'previous-1'} (stopped before a checkpoint)" in capsys.readouterr().out
    assert {log: (tmp_path / "previous-1" / log).read_text() for log in earlier} == earlier
    assert [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]


def test_update_shuffles_its_minibatches_by_the_step_seed(warm, monkeypatch):
    # step_seed is the one source of a step's randomness, the learner's shuffle included: with minibatches of 4 of
    # the 16 rollouts, which rollouts share an AdamW step is a function of the seed rl_step hands `update`. The
    # rows of each micro-batch are read from the advantages, set to the row numbers (SGD at lr 0: nothing moves)
    learner = spy(monkeypatch, train, "update")
    args = train.parse_args(SMALL + ["--minibatch", "4", "--micro-batch", "2", "--ppo-epochs", "2", "--seed", "1"])
    model, tokenizer = models.load_pretrained(str(warm))
    small_step(model, tokenizer, args, step=3)
    (_, _, rollouts, logp_old, _, mask, weights, _, _, seed), _, _ = learner[0]
    assert seed == train.step_seed(args, 3)
    losses = spy(monkeypatch, train.C, "policy_loss")

    def minibatches(seed):
        losses.clear()
        train.update(model, torch.optim.SGD(model.parameters(), lr=0.0), rollouts, logp_old,
                     torch.arange(16.0), mask, weights, None, args, seed)
        rows = [a[2].long().tolist() for a, _, _ in losses]             # micro-batches of 2, minibatches of 4
        batches = [frozenset(rows[i] + rows[i + 1]) for i in range(0, len(rows), 2)]
        for epoch in (batches[:4], batches[4:]):                        # every epoch: each rollout once
            assert sorted(r for b in epoch for r in b) == list(range(16))
        return batches
    assert minibatches(seed) == minibatches(seed) != minibatches(seed + 1)


def test_the_steps_loss_and_clip_fraction_are_means_over_its_adamw_steps(warm, monkeypatch):
    # 2 epochs of 16 rollouts in minibatches of 8, each in micro-batches of 3, 3 and 2 (seq-mean: a micro-batch is
    # rows / 8 of its minibatch's mean); lr 1e-2 moves the weights enough that some later minibatches clip. The step's
    # loss and clip_frac: the mean over the 4 AdamW steps of each minibatch's own, from the policy_loss outputs
    calls = spy(monkeypatch, train.C, "policy_loss")
    args = train.parse_args(SMALL + ["--ppo-epochs", "2", "--minibatch", "8", "--micro-batch", "3"])
    model, tokenizer = models.load_pretrained(str(warm))
    metrics = small_step(model, tokenizer, args, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert [len(a[0]) for a, _, _ in calls] == [3, 3, 2] * 4
    # clip_frac: a minibatch's clipped tokens over its kept tokens, whatever its micro-batches
    parts = [(len(a[0]) / 8 * out[0].item(), out[1]["clip_frac"] * out[1]["tokens"], out[1]["tokens"])
             for a, _, out in calls]
    sums = [[sum(p[j] for p in parts[i: i + 3]) for j in (0, 1, 2)] for i in range(0, 12, 3)]   # per AdamW step
    steps = [(loss, clipped / max(kept, 1)) for loss, clipped, kept in sums]
    assert len({round(loss, 6) for loss, _ in steps}) == 4 and len({round(clip, 6) for _, clip in steps}) > 1
    assert metrics["loss"] == pytest.approx(sum(loss for loss, _ in steps) / 4, rel=1e-5)
    assert metrics["clip_frac"] == pytest.approx(sum(clip for _, clip in steps) / 4, rel=1e-5)


def test_a_data_file_that_leaves_exactly_a_steps_prompts_trains_on_all_of_them(tmp_path):
    # 12 lines, 3 held out: 9 training examples make a step of --prompts 9 (each once), not of 10
    data = tmp_path / "d.jsonl"
    data.write_text("".join('{"question": "1+%d?", "answer": "#### %d"}\n' % (i, i + 1) for i in range(12)))
    argv = ["--model", "m", "--data", str(data), "--eval-size", "3", "--prompts"]
    args = train.parse_args(argv + ["9"])
    training, _ = train.load_data(args)
    assert sorted(int(e["answer"]) for e in train.step_examples(args, training, 1)) == list(range(1, 10))
    with pytest.raises(ValueError, match="leaves 9 training examples after the 3 held out .* --prompts 10"):
        train.load_data(train.parse_args(argv + ["10"]))
    # with --eval-data the whole file trains: it said "after the 3 held out (--eval-size) ...: pass --eval-data"
    with pytest.raises(ValueError, match="d.jsonl holds 12 training examples; a step needs --prompts 13$"):
        train.load_data(train.parse_args(argv + ["13", "--eval-data", str(data)]))
    training, held_out = train.load_data(train.parse_args(argv + ["10", "--steps", "0"]))   # evaluate only: no step
    assert len(training) == 9 and [e["answer"] for e in held_out] == ["10", "11", "12"]



def test_an_eval_file_shorter_than_eval_size_is_evaluated_whole_and_said(tmp_path, capsys):
    # --eval-data of 5 examples at --eval-size 8 evaluated those 5 without a word: a run's accuracy over fewer prompts
    # than asked for; at --eval-size 5 (what it holds) or less, nothing is said
    data, held = tmp_path / "d.jsonl", tmp_path / "h.jsonl"
    data.write_text("".join('{"question": "1+%d?", "answer": "#### %d"}\n' % (i, i + 1) for i in range(4)))
    held.write_text("".join('{"question": "2+%d?", "answer": "#### %d"}\n' % (i, i + 2) for i in range(5)))
    argv = ["--model", "m", "--data", str(data), "--eval-data", str(held), "--prompts", "2", "--eval-size"]
    _, held_out = train.load_data(train.parse_args(argv + ["8"]))
    assert [e["answer"] for e in held_out] == ["2", "3", "4", "5", "6"]
    assert capsys.readouterr().out == f"held out: all 5 examples of {held}, < --eval-size 8\n"
    for size in ("5", "3"):
        _, held_out = train.load_data(train.parse_args(argv + [size]))
        assert len(held_out) == int(size) and capsys.readouterr().out == ""

def test_bf16_runs_every_forward_of_a_step_under_autocast(warm, monkeypatch):
    # --dtype bfloat16: sampling, re-scoring and the update's forward passes all run under bf16 autocast (the
    # backward outside it); read inside each call as it runs
    seen = {}

    def watched(name, real):
        def call(*args, **kwargs):                                      # the autocast state as the call runs
            seen.setdefault(name, set()).add(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"))
            return real(*args, **kwargs)
        return call
    for owner, name in ((train, "generate"), (train.C, "dense_logprobs"), (train.C, "response_logprobs")):
        monkeypatch.setattr(owner, name, watched(name, getattr(owner, name)))
    model, tokenizer = models.load_pretrained(str(warm))
    small_step(model, tokenizer, train.parse_args(SMALL + ["--dtype", "bfloat16"]))
    assert seen == {name: {torch.bfloat16} for name in ("generate", "dense_logprobs", "response_logprobs")}


# ----------------------------------------------------------------------------- flags the loaded model decides on

FITS = ["--task", "sort", "--digits", "4", "8", "--warmup-steps", "0", "--max-new-tokens", "10", "--budget", "10",
        "--window", "2"]                                              # the longest prompt: 11 tokens


def test_dense_layers_past_the_model_is_refused_not_a_dense_run(tmp_path):
    # --policy blocktopk --dense-layers 99 on the 2-layer toy trained 200 steps of dense rollouts (alpha 1.000)
    with pytest.raises(SystemExit) as exit_info:
        train.main(FITS + ["--policy", "blocktopk", "--page-size", "2", "--dense-layers", "2",
                           "--out", str(tmp_path)])
    assert str(exit_info.value) == ("error: --dense-layers 2: the model has 2 layers, so block top-k would attend to "
                                    "every token in each; give at most 1")
    assert not (tmp_path / "metrics.jsonl").exists()


def test_an_interval_no_rollout_reaches_is_refused_not_a_dense_run(tmp_path):
    # --interval 100000 never compressed: "snapkv, budget 12" rollouts were full ones (rho 1.000, alpha 1.000).
    # 11 + 10 - 1 = 20 tokens at the last decode step: interval 10 compresses once (as the sampler counts), 11 never
    with pytest.raises(SystemExit) as exit_info:
        train.main(FITS + ["--interval", "11", "--out", str(tmp_path)])
    assert str(exit_info.value) == ("error: --interval 11: a cache compresses once it holds budget + interval = 21 "
                                    "tokens, and the longest rollout holds at most 20 (prompt 11 + --max-new-tokens 10 "
                                    "- 1), so budget 10 would never evict: give --interval at most 10")
    assert not (tmp_path / "metrics.jsonl").exists()
    model = models.toy_model(char_tokenizer())
    assert cli.check_fits(train.parse_args(FITS + ["--interval", "10"]), model, 11) is None
    for interval, compresses in ((10, True), (11, False)):           # the boundary, as the sampler has it
        sparse = SparseConfig("snapkv", budget=10, interval=interval, window=2)
        out = generate(model, [list(range(3, 14))], sparse, max_new_tokens=10)   # 11 tokens, never an EOS
        assert (out.stats["compressions"] > 0) == compresses
    # a budget that holds the whole rollout: "snapkv, budget 100" was a dense run (alpha p05 1.000), accepted
    for budget in (20, 100):
        with pytest.raises(ValueError, match=rf"^--budget {budget}: the longest rollout holds at most 20 tokens "
                                             r"\(prompt 11 \+ --max-new-tokens 10 - 1\), so snapkv would never "
                                             r"evict: give a budget below 20, or --policy full for a dense run$"):
            cli.check_fits(train.parse_args(FITS + ["--budget", str(budget)]), model, 11)
    assert cli.check_fits(train.parse_args(FITS + ["--budget", "19", "--interval", "1"]), model, 11) is None
    assert cli.check_fits(train.parse_args(FITS + ["--budget", "100", "--policy", "full"]), model, 11) is None


def test_a_block_top_k_budget_that_attends_every_page_is_refused_not_a_dense_run():
    # 20 tokens at the last decode step are 10 pages of 2; block top-k attends budget // 2 + 3 reserved pages, so
    # budget 14 attends all 10 (a dense run under a budget's name, as schedule.py --calibrate already refuses) and
    # 13 skips one. Was: check_fits checked the eviction policies only
    model = models.toy_model(char_tokenizer())
    blocktopk = FITS + ["--policy", "blocktopk", "--page-size", "2", "--dense-layers", "1"]
    for argv, flag in ((["--budget", "14"], "--budget"),
                       (["--steps", "0", "--eval-budgets", "13", "14"], "--eval-budgets")):
        with pytest.raises(ValueError, match=rf"^{flag} 14: the longest rollout holds at most 20 tokens \(prompt 11 "
                                             r"\+ --max-new-tokens 10 - 1\), 10 pages of 2, and blocktopk attends 10 .*: "
                                             r"every page, so it would never skip one: give a budget below 14, or "
                                             r"--policy full for a dense run$"):
            cli.check_fits(train.parse_args(blocktopk + argv), model, 11)
    assert cli.check_fits(train.parse_args(blocktopk + ["--budget", "13"]), model, 11) is None


def test_a_lora_rank_wider_than_the_model_is_one_line_not_an_allocator_traceback(tmp_path):
    # --distill kl --lora-rank 1000000000: torch tried to allocate 512 GB, a RuntimeError traceback
    with pytest.raises(SystemExit) as exit_info:
        train.main(FITS + ["--distill", "kl", "--lora-rank", "1000000000", "--out", str(tmp_path)])
    assert str(exit_info.value) == ("error: the LoRA rank (--lora-rank) must be an integer from 1 to 128 (min(in, "
                                    "out) of the model's widest linear layer), got 1000000000")
    assert not (tmp_path / "metrics.jsonl").exists()


def half_written(monkeypatch):
    """Make every Path.write_text write half its text, then die as a kill would."""
    def write_half(self, text, *args, **kwargs):
        with open(self, "w") as f:
            f.write(text[: len(text) // 2])
        raise KeyboardInterrupt
    monkeypatch.setattr(train.Path, "write_text", write_half)


def test_a_kill_while_truncating_a_log_keeps_the_old_log_whole(tmp_path, monkeypatch):
    # --resume rewrote metrics.jsonl in place: a kill mid-write lost the steps before the checkpoint
    log = tmp_path / "metrics.jsonl"
    text = "".join(json.dumps(dict(step=s, reward=0.5)) + "\n" for s in range(1, 9))
    log.write_text(text)
    half_written(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        train.truncate_log(log, 4)
    assert log.read_text() == text


def test_an_unreadable_cached_warm_up_is_made_anew_not_a_bare_json_error(tmp_path, capsys):
    # a warmup.json that is no JSON ended the run in "error: Expecting property name enclosed in double quotes: ..."
    (tmp_path / "warmup").mkdir()
    (tmp_path / "warmup" / "warmup.json").write_text("{bad")
    args = train.parse_args(FITS + ["--out", str(tmp_path)])
    train.load_model(args, torch.device("cpu"))
    assert capsys.readouterr().out.splitlines()[0] == (
        f"{tmp_path / 'warmup'} was made with unrecorded settings; making a new warm-up for {{'task': 'sort', "
        f"'digits': [4, 8], 'warmup_steps': 0, 'seed': 0, 'alphabet': '{train.ALPHABET}'}}")
    assert json.loads((tmp_path / "warmup" / "warmup.json").read_text())["task"] == "sort"


def test_restore_refuses_a_checkpoint_that_does_not_fit_the_run_and_says_a_new_lr(tmp_path, capsys):
    """train.restore's one-line exits, each on a hand-made state: controller budgets for another number of bins, and
    --distill on a checkpoint with no adapter file; and the line that says the command line's lr replaces the saved one
    (mutants that survived: the bins' count check dropped, the adapter file's check dropped, the lr line dropped)."""
    import distill
    model = models.toy_model(char_tokenizer())
    saved = torch.optim.AdamW(model.parameters(), lr=0.1)
    args = train.parse_args(["--lr", "3e-5", "--controller", "0.86", "--bin-size", "16", "--max-new-tokens", "12",
                             "--budget", "12"])
    controller = train.sparse_config(args, longest_prompt=20).schedule           # bins 0, 16: 20 + 12 tokens
    state = dict(step=2, optimizer=saved.state_dict(), torch_rng=torch.get_rng_state(), budgets=[8])
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    with pytest.raises(SystemExit, match=r"^error: .* holds no controller budgets for 2 bins \(found \[8\]\); "):
        train.restore(state, tmp_path, args, opt, None, None, controller)
    assert capsys.readouterr().out == "learning rate 3e-05 (the checkpoint was trained at 0.1)\n"
    lora = distill.LoRA(model, 2)
    state = dict(state, budgets=[8, 11], lora_optimizer=torch.optim.AdamW(lora.parameters(), lr=0.1).state_dict())
    with pytest.raises(SystemExit, match="^error: .* holds no DistillSparse adapter; resume it without --distill$"):
        train.restore(state, tmp_path, args, opt, lora, torch.optim.AdamW(lora.parameters(), lr=1.0), controller)


def test_each_adamw_step_sees_its_own_minibatchs_gradient_alone(warm, monkeypatch):
    # 2 epochs of one minibatch (all 16 rollouts) at SGD lr 0, gradients unclipped: the weights never move, so both
    # steps must see the same gradient, that of the batch's loss. Mutant that survived: opt.zero_grad dropped (the
    # second step then took the sum of both epochs' gradients, twice the first)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *args, **kwargs: None)
    model, tokenizer = models.load_pretrained(str(warm))
    opt, grads = torch.optim.SGD(model.parameters(), lr=0.0), []
    real_step = opt.step
    monkeypatch.setattr(opt, "step", lambda *a, **k: grads.append(
        torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])) or real_step(*a, **k))
    small_step(model, tokenizer, train.parse_args(SMALL + ["--ppo-epochs", "2"]), opt)
    assert len(grads) == 2 and grads[0].abs().max() > 1e-6
    assert torch.allclose(grads[1], grads[0], atol=1e-6)


def test_a_cached_warm_up_still_refuses_a_budget_no_rollout_exceeds(tmp_path, warm):
    # Pins main's check_fits after loading: with the warm-up cached, load_model's own check never runs, so without
    # main's a --budget of 40 (the longest rollout holds 11 + 10 - 1 = 20 tokens) trained a dense run under
    # snapkv's name. Mutant that survived: main's check_fits dropped
    shutil.copytree(warm, tmp_path / "warmup")
    with pytest.raises(SystemExit, match=r"^error: --budget 40: the longest rollout holds at most 20 tokens "):
        train.main(SMALL + ["--out", str(tmp_path), "--budget", "40"])
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_sparse_rl_steps_line_counts_the_tokens_rejection_dropped(warm, monkeypatch):
    # metrics.jsonl's vetoed and dropped_tokens (the progress bar's and the summary's) are the step's own, counted here
    # from the masks before and after rejection and from rho < veto by hand; the zeros are only for runs without
    # rejection. Mutant that survived: the zeros written over the counts ({**metrics, "vetoed": 0, ...})
    rejected = spy(monkeypatch, train.C, "rejection_mask")
    model, tokenizer = models.load_pretrained(str(warm))
    metrics = small_step(model, tokenizer, train.parse_args(SMALL + ["--band", "0.9", "1.1", "--veto", "0.5"]))
    (log_rho, mask, *_), _, (kept, _) = rejected[0]
    real = mask > 0
    dropped, vetoed = int(real.sum() - (kept > 0).sum()), int(((log_rho.exp() < 0.5) & real).any(-1).sum())
    assert dropped > 0 and (metrics["dropped_tokens"], metrics["vetoed"]) == (dropped, vetoed)


def test_band_reaches_the_out_of_band_metric_and_adamw_decays_nothing(tmp_path, warm, monkeypatch):
    # --band feeds the out_of_band metric under every correction (cli's help), and AdamW runs without weight
    # decay (docs/method.md section 8): mutants not passing the band, or dropping weight_decay=0.0 (AdamW's
    # default is 0.01), survived the other tests
    shutil.copytree(warm, tmp_path / "warmup")
    bands, decays = [], []
    stats, adamw = train.C.mismatch_stats, torch.optim.AdamW
    monkeypatch.setattr(train.C, "mismatch_stats", lambda *a, **k: bands.append(a[5:]) or stats(*a, **k))
    monkeypatch.setattr(torch.optim, "AdamW", lambda params, **k: decays.append(k.get("weight_decay")) or
                        adamw(params, **k))
    train.main(SMALL + ["--out", str(tmp_path), "--steps", "1", "--band", "0.9", "1.1", "--correction", "tis"])
    assert bands == [(0.9, 1.1)] and decays == [0.0]
