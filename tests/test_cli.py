"""cli.py: the defaults each kind of run takes, what --help shows, and what the parser refuses.

The checks of bad values (`check_args`) are run through train.main, where they must stop a run before anything
is trained; the refusals of train.py's own (resume, caches, model, schedule) are in tests/test_train.py.
"""
import argparse
from pathlib import Path

import pytest

import cli
import models
import train


def test_defaults_are_the_official_sparse_rl_settings():
    """docs/method.md section 5: veto 1e-4, band [0.5, 1.5], cap 1.5, clip 0.2, no KL unless asked; all n rollouts
    kept."""
    args = cli.parse_args([])
    assert (args.veto, args.band, args.cap, args.clip, args.kl, args.correction) == (1e-4, [0.5, 1.5], 1.5, 0.2, 0.0,
                                                                                     "sparse-rl")
    assert (args.keep, args.no_std, args.agg) == (args.group_size, False, "seq-mean")
    # Sparrow's DistillSparse (section 6): KL weight 1e-3, the adapter's lr 5x the base one
    assert (args.distill_lambda, args.lora_lr_scale) == (1e-3, 5.0)


def test_the_paper_preset_is_sparse_rl_and_sparrow_as_method_md_gives_them():
    # docs/method.md sections 2, 3, 5: budget 512, compress every 128, window 8, sink 4, lr 1e-6; Sparrow's pages of 16
    # and 2 dense layers; 512 new tokens (not the paper's 4096: cli.py says why), bins of 128
    assert cli.PAPER == dict(budget=512, interval=128, window=8, sink=4, max_new_tokens=512, lr=1e-6, bin_size=128,
                             page_size=16, dense_layers=2)


def test_toy_defaults_follow_the_task_and_save_every_a_quarter_of_the_steps():
    assert cli.parse_args(["--task", "sort"]).digits == [12, 20] and cli.parse_args([]).digits == [3, 6]
    # a pretrained --model on a toy task (no --data) plays it at the task's lengths too, not pick's 3-6
    assert cli.parse_args(["--model", "m", "--task", "reverse"]).digits == [12, 20]
    assert cli.parse_args(["--model", "smollm2-135m", "--task", "sort"]).digits == [12, 20]
    save_every = lambda steps: cli.parse_args(["--steps", str(steps)]).save_every
    assert (save_every(40), save_every(400), save_every(2)) == (10, 50, 1)   # steps // 4, at most 50, at least 1


def test_smollm2_gets_cpu_sized_defaults_that_flags_override():
    args = cli.parse_args(["--model", "smollm2-135m", "--prompts", "3"])
    assert (args.budget, args.max_new_tokens, args.group_size, args.prompts, args.temperature) == (128, 128, 4, 3, 0.7)
    assert Path(args.data).name == "arithmetic_train.jsonl" and Path(args.eval_data).is_file()   # committed data
    other = cli.parse_args(["--model", "smollm2-135m", "--data", "gsm8k.jsonl"])        # none of arithmetic's settings
    assert (other.data, other.eval_data, other.max_new_tokens, other.temperature) == ("gsm8k.jsonl", None, 256, 1.0)
    assert cli.parse_args(["--model", "org/name"]).budget == 512            # any other model: the paper's


def test_the_gpu_preset_is_chosen_by_device_cuda_and_yields_to_flags():
    gpu = cli.parse_args(["--model", models.SMOLLM2, "--device", "cuda"])
    assert (gpu.prompts, gpu.group_size, gpu.keep, gpu.max_new_tokens) == (16, 8, 8, 256)
    assert (gpu.budget, gpu.interval, gpu.policy, gpu.temperature, gpu.lr) == (128, 32, "snapkv", 0.7, 1e-6)
    assert (gpu.steps, gpu.eval_every, gpu.eval_size, gpu.dtype) == (20, 10, 64, "bfloat16")
    assert Path(gpu.data).name == "arithmetic_train.jsonl" and Path(gpu.eval_data).name == "arithmetic_test.jsonl"
    cpu = cli.parse_args(["--model", models.SMOLLM2])                    # the CPU preset, as before
    assert (cpu.prompts, cpu.group_size, cpu.max_new_tokens, cpu.steps, cpu.dtype) == (2, 4, 128, 5, "float32")
    assert cli.parse_args(["--model", models.SMOLLM2, "--device", "cpu"]).prompts == 2
    assert cli.parse_args(["--model", models.SMOLLM2, "--device", "cuda", "--data", "x.jsonl"]).prompts == 2   # CPU
    flags = cli.parse_args(["--model", models.SMOLLM2, "--device", "cuda", "--steps", "3", "--dtype", "float32"])
    assert (flags.steps, flags.dtype, flags.prompts) == (3, "float32", 16)
    assert cli.parse_args([]).dtype == "float32" and cli.parse_args([]).eval_every == 50    # the toy run's


def test_help_shows_the_value_each_flag_will_have(capsys):
    for argv, shown in (([], "(default: 12)"), (["--task", "sort"], "(default: 24)"),
                        (["--model", "smollm2-135m"], "(default: 128)"), (["--model", "a/b"], "(default: 512)")):
        with pytest.raises(SystemExit):
            cli.parse_args(argv + ["--help"])
        text = " ".join(capsys.readouterr().out.split())
        text = text[text.index("model and data:"):]                       # the flags' help, not the usage line
        budget = text[text.index("--budget BUDGET"):text.index("--interval INTERVAL")]
        assert shown in budget
        for flag in ("--interval", "--window", "--sink", "--bin-size", "--max-new-tokens", "--lr"):
            assert "(default: None)" not in text[text.index(flag + " "):][:300].split(" --")[0], flag


def test_a_mistyped_choice_is_two_lines_not_the_usage_of_every_flag(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--policy", "snapvk"])
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "--help" in err[0] and err[1].endswith("invalid choice: 'snapvk' (choose from 'full', "
                                                                     "'streaming', 'h2o', 'snapkv', 'rkv', 'random', 'blocktopk')")
    with pytest.raises(SystemExit):                                    # the preset's own parser printed its usage
        cli.parse_args(["--task", "Pick"])
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "--help" in err[0] and err[1].endswith("invalid choice: 'Pick' (choose from 'pick', "
                                                                     "'reverse', 'sort')")


def test_block_topk_has_pages_that_fit_the_run():
    # the toy's budget of 12 is under Sparrow's page of 16, and its 2 layers would both be Sparrow's dense ones:
    # the toy pages by 4 with layer 0 dense; a real model keeps Sparrow's 16 and 2
    toy = train.sparse_config(cli.parse_args(["--policy", "blocktopk"]))
    real = train.sparse_config(cli.parse_args(["--policy", "blocktopk", "--model", "org/name"]))
    assert (toy.budget, toy.page_size, toy.dense_layers) == (12, 4, 1)
    assert (real.budget, real.page_size, real.dense_layers) == (512, 16, 2)


@pytest.mark.parametrize("argv", [["--task", "count"], ["--policy", "lru"]])
def test_unknown_task_or_policy_is_refused_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(argv)
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--data", "missing.jsonl", "--model", "x/y"], "data file 'missing.jsonl' does not exist"),
    (["--group-size", "1"], "--group-size must be >= 2"),
    (["--group-size", "4", "--keep", "6"], "--keep m must lie in \\[2, group size n=4\\], got 6"),
    (["--keep", "1"], "--keep m must lie in \\[2, group size n=8\\], got 1"),
    (["--keep", "0"], "--keep m must lie in \\[2, group size n=8\\], got 0"),
    (["--prompts", "0"], "--prompts must be >= 1, got 0"),
    (["--eval-every", "0"], "--eval-every must be >= 1, got 0"),                # else a modulo by zero at step 1
    (["--data", "d.jsonl"], "--data needs --model"),
    (["--eval-data", "d.jsonl"], "--eval-data 'd.jsonl' needs --data \\(and --model\\)"),   # was ignored: toy prompts
    (["--digits", "5", "3"], "--digits needs 1 <= MIN <= MAX, got \\[5, 3\\]"),
    (["--task", "reverse", "--digits", "12", "30"], "--max-new-tokens 24 cuts off the toy answers of up to 30 "
     "digits"),                                                               # was: every long answer cut, silently
    (["--data", ".", "--model", "x/y"], "data file '.' is a folder, not a file"),
    (["--steps", "0", "--controller", "0.86"], "--steps 0 evaluates fixed budgets"),
    (["--temperature", "0"], "--temperature 0 samples greedily"),
    (["--temperature", "nan"], "--temperature must be a finite number, got nan"),
    (["--band", "0.5", "inf"], "--band must be a finite number, got inf"),
    (["--seed", str(2 ** 32)], "--seed must be < 2\\*\\*32"),
    (["--gguf-file", "m.gguf"], "--gguf-file 'm.gguf' needs --model"),
    (["--steps", "-1"], "--steps must be >= 0, got -1"),
    (["--eval-budgets", "24"], "--eval-policies and --eval-budgets go with --steps 0"),
    (["--distill", "kl", "--policy", "full"], "--distill trains an adapter for a sparse sampler"),
    (["--lora-rank", "0"], "--lora-rank must be >= 1, got 0"),
    (["--cap", "0"], "--cap must be > 0, got 0.0"),
    (["--band", "1.5", "0.5"], "need 0 <= low < high for the rho band, got low=1.5, high=0.5"),
    (["--lr", "-1"], "--lr must be > 0, got -1.0"),
    (["--veto", "-1"], "--veto must be >= 0, got -1.0"),
    (["--kl", "-1"], "--kl must be >= 0, got -1.0"),
    (["--lr", "0"], "--lr must be > 0, got 0.0"),
    (["--threads", "0"], "--threads must be >= 1 \\(or left out: chosen by model size\\), got 0"),
    (["--clip", "0"], "--clip must be > 0, got 0.0"),
    (["--warmup-steps", "-1"], "--warmup-steps must be >= 0, got -1"),
    (["--minibatch", "0"], "--minibatch must be >= 1 \\(or left out: all rollouts\\), got 0"),
    (["--micro-batch", "0"], "--micro-batch must be >= 1, got 0"),
    (["--schedule", "s.json", "--controller", "0.86"], "give --schedule FILE or --controller THRESHOLD, not both"),
    (["--controller", "0.86", "--policy", "full"], "--policy full keeps everything"),
    (["--controller", "2"], "--controller THRESHOLD is a 5th-percentile acceptance in \\[0, 1\\] .*got 2.0"),
    (["--distill", "ppo-kl", "--policy", "full"], "--distill trains an adapter for a sparse sampler"),   # both kinds
    (["--temperature", "-1"], "--temperature must be >= 0, got -1.0"),
    (["--temperature", "1e-40"], "--temperature must be 0 \\(greedy\\) or at least 1e-06, got 1e-40"),   # was: NaN
    (["--distill-lambda", "-1"], "--distill-lambda must be >= 0, got -1.0"),
    (["--lora-lr-scale", "0"], "--lora-lr-scale must be > 0, got 0.0"),
    (["--schedule", "s.json", "--steps", "0"], "--steps 0 evaluates fixed budgets"),
    (["--schedule", "s.json", "--policy", "full"], "--policy full keeps everything"),   # a schedule as a controller
    (["--eval-policies", "h2o"], "--eval-policies and --eval-budgets go with --steps 0"),   # either one alone
    (["--ppo-epochs", "0"], "--ppo-epochs must be >= 1, got 0"),                # else no update at all
    (["--save-every", "0"], "--save-every must be >= 1, got 0"),                # else a modulo by zero at its step
    (["--budget", str(2 ** 40 + 1)], "budget must be at most 2\\*\\*40 \\(DENSE: never evicts\\), got 1099511627777"),
    (["--micro-batch", str(2 ** 63)], "--micro-batch must be < 2\\*\\*31"),     # ... in a traceback after the load
    (["--eval-budgets", "8", str(2 ** 63), "--steps", "0"], "the evaluation cache snapkv at budget 9223372036854775808: "
     "budget must be at most 2\\*\\*40"),
    (["--schedule", ""], "--schedule is empty: give a value, or leave the flag out"),   # was: no schedule, silently
    (["--cache-dir", ""], "--cache-dir is empty"),                           # was: a GGUF model cached in ./
    # each count of check_args' lists by name, not a later check's unnamed refusal (or none: --bin-size, --eval-size)
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--budget", "0"], "--budget must be >= 1, got 0"),
    (["--bin-size", "0"], "--bin-size must be >= 1, got 0"),
    (["--eval-size", "0"], "--eval-size must be >= 1, got 0"),
    (["--page-size", "0"], "^error: --page-size must be >= 1, got 0$"),         # was: "page_size must be a positive
    (["--sink", "-1"], "^error: --sink must be >= 0, got -1$"),                 # integer, got 0", SparseConfig's
    (["--dense-layers", "-1"], "^error: --dense-layers must be >= 0, got -1$"),  # name of it
    # the toy task's flags beside --data: were ignored, silently (a numeric reward, whatever --reward said)
    (["--model", "smollm2-135m", "--data", "d.jsonl", "--reward", "exact"], "^error: --reward exact: for the toy task "
     "only; --data brings its own prompts, its answers scored by tasks.numeric_reward \\(leave it out\\)$"),
    (["--model", "m", "--data", "d.jsonl", "--task", "sort", "--reward", "exact"], "--task sort, --reward exact: for"),
    # were ignored too: --data's prompts are its own, and a --model is never warmed up (trained from its weights)
    (["--model", "m", "--data", "d.jsonl", "--digits", "4", "9"], "^error: --digits 4 9: for the toy task only; "),
    (["--model", "smollm2-135m", "--warmup-steps", "50"], "^error: --warmup-steps 50: the toy model's supervised "
     "phase; a --model trains from its own weights \\(leave it out\\)$"),
])
def test_each_bad_value_is_one_clear_line_before_training(tmp_path, argv, message):
    with pytest.raises(SystemExit, match=message) as exit_info:
        train.main(argv + ["--out", str(tmp_path / "run")])
    assert str(exit_info.value).startswith("error: ") and "\n" not in str(exit_info.value)
    assert not (tmp_path / "run" / "warmup").exists()                 # nothing was trained


def test_evaluate_only_takes_temperature_0():
    # the greedy check is training's: an evaluation (--steps 0) decodes greedily whatever --temperature says, so
    # a --temperature 0 there is no error (evaluate.py passes train.py's flags, its run's temperature included)
    for argv in (["--steps", "0", "--temperature", "0"], ["--steps", "0", "--temperature", "0", "--eval-budgets", "8"]):
        assert cli.check_args(cli.parse_args(argv)) is None
    with pytest.raises(ValueError, match="--temperature 0 samples greedily"):
        cli.check_args(cli.parse_args(["--steps", "1", "--temperature", "0"]))


@pytest.mark.parametrize("argv, message", [
    (["--downsample", "random"], "--downsample random: only --keep below --group-size reads it"),
    (["--group-size", "4", "--keep", "4", "--downsample", "max-reward"],
     "--downsample max-reward: only --keep below --group-size reads it"),
    (["--correction", "none", "--cap", "3"], "--cap 3.0: only --correction tis or sparse-rl reads it"),
    (["--correction", "tis", "--veto", "0.01"], "--veto 0.01: only --correction sparse-rl reads it"),
    (["--correction", "none", "--veto", "0.01"], "--veto 0.01: only --correction sparse-rl reads it"),
    (["--distill", "kl", "--distill-lambda", "5"], "--distill-lambda 5.0: only --distill ppo-kl reads it"),
    (["--distill-lambda", "5"], "--distill-lambda 5.0: only --distill ppo-kl reads it"),
    (["--lora-rank", "4"], "--lora-rank 4: only --distill reads it"),
    (["--lora-lr-scale", "3"], "--lora-lr-scale 3.0: only --distill reads it"),
    # pages are block top-k's alone (was: ignored, silently, by every other policy)
    (["--page-size", "8"], "--page-size 8: only --policy blocktopk reads it"),
    (["--model", "m", "--policy", "h2o", "--dense-layers", "4"], "--dense-layers 4: only --policy blocktopk reads it"),
    (["--model", "smollm2-135m", "--page-size", "4"], "--page-size 4: only --policy blocktopk reads it"),
])
def test_a_training_flag_no_other_setting_reads_is_refused_not_ignored(argv, message):
    # each trained as if left out, with no word (--distill kl --distill-lambda 5: the KL at weight 1, as its help says)
    with pytest.raises(ValueError) as error:
        cli.check_args(cli.parse_args(argv))
    assert str(error.value) == message + " (leave it out)"


def test_the_flags_a_run_does_not_read_pass_at_their_defaults_and_where_read():
    # the refusal above compares with each flag's default: a default changed in parse_args alone would refuse it
    for argv in (["--correction", "none"], ["--correction", "tis", "--cap", "3"], ["--keep", "4", "--downsample",
                 "random"], ["--distill", "ppo-kl", "--distill-lambda", "5", "--lora-rank", "4", "--lora-lr-scale",
                 "3"], ["--distill", "kl", "--lora-rank", "4"], ["--veto", "0.01", "--cap", "3"],
                 ["--steps", "0", "--correction", "none", "--cap", "3", "--downsample", "random", "--lora-rank", "4"],
                 # the pages' defaults are the preset's: toy pages of 4 and 1 dense layer, 16 and 2 for a --model
                 ["--task", "sort", "--policy", "full"], ["--model", "smollm2-135m"],
                 ["--model", "m", "--policy", "h2o"],
                 ["--policy", "blocktopk", "--page-size", "8", "--dense-layers", "0"],
                 ["--steps", "0", "--eval-policies", "h2o", "--page-size", "8"]):
        assert cli.check_args(cli.parse_args(argv)) is None, argv


def test_an_empty_out_is_refused_not_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                       # Path("") is ".": the run went into the current folder
    with pytest.raises(SystemExit, match="^error: --out is empty: give a value, or leave the flag out"):
        train.main(["--out", ""])
    assert not any(tmp_path.iterdir())


def test_check_values_refuses_integers_from_2_31_only():
    # Pins check_values' overflow check: an int of 2**31 (torch's int32 limit) is refused, 2**31 - 1 is not; a float
    # never is (2.0**40 is a fine number), nor a flag in `unchecked` (default: --seed, which has its own < 2**32)
    ns = argparse.Namespace
    cli.check_values(ns(budget=2 ** 31 - 1, lr=2.0 ** 40, seed=2 ** 40))
    with pytest.raises(ValueError, match="^--budget must be < 2\\*\\*31, got 2147483648$"):
        cli.check_values(ns(budget=2 ** 31))
    with pytest.raises(ValueError, match="^--seed must be < 2\\*\\*31, got 1099511627776$"):
        cli.check_values(ns(seed=2 ** 40), unchecked=())


def test_a_budget_may_be_dense_as_in_every_other_script():
    # --budget and --eval-budgets are SparseConfig's (up to DENSE = 2**40: never evicts), not check_values' < 2**31,
    # as static.py and report.py take them; DENSE + 1 is refused by SparseConfig (the cases above)
    dense = str(2 ** 40)
    assert cli.check_args(cli.parse_args(["--policy", "h2o", "--budget", dense])) is None
    assert cli.check_args(cli.parse_args(["--steps", "0", "--eval-budgets", "16", dense])) is None


def test_check_out_file_makes_every_missing_folder_before_the_work(tmp_path):
    # Pins check_out_file's mkdir(parents=True): an --out two new folders deep is made ready, not refused
    cli.check_out_file(str(tmp_path / "a" / "b" / "run.json"))
    assert (tmp_path / "a" / "b").is_dir() and not (tmp_path / "a" / "b" / "run.json").exists()


def test_threads_beyond_the_cores_is_one_line_not_a_memory_error(monkeypatch):
    # --threads 100000 asked torch and the tokenizer for 100000 threads: a MemoryError traceback after ~8 s
    monkeypatch.setattr(cli.os, "cpu_count", lambda: 2)
    assert cli.check_args(cli.parse_args(["--threads", "2"])) is None
    with pytest.raises(ValueError) as error:
        cli.check_args(cli.parse_args(["--threads", "100000"]))
    assert str(error.value) == "--threads must be at most this machine's 2 CPU cores, got 100000"


def test_a_veto_of_1_or_more_is_refused_not_every_response_vetoed():
    # --veto 1e4 (for 1e-4) vetoed all 128 responses of a step: 100% of tokens dropped, the weights never moved
    with pytest.raises(ValueError) as error:
        cli.check_args(cli.parse_args(["--veto", "1e4"]))
    assert str(error.value) == ("--veto must be < 1 (a response with any rho below it leaves the loss; Sparse-RL's "
                                "1e-4), got 10000.0")


def test_the_band_help_says_only_sparse_rl_drops_tokens(capsys):
    # train.rl_step applies the band's rejection under --correction sparse-rl alone; tis and none keep every token
    # and read the band only for the out_of_band metric. The help said "tokens ... leave the loss", for every run
    with pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    band = text[text.index("--band LOW HIGH"):text.index("--cap CAP")]
    assert band.startswith("--band LOW HIGH with --correction sparse-rl, tokens with rho outside [LOW, HIGH] leave the "
                           "loss; in every run their share is the metric out_of_band")


@pytest.mark.parametrize("band", [["0", "0.9"], ["1.1", "2"]])
def test_a_band_without_rho_1_is_refused_not_every_token_dropped(band):
    # --band 0 0.9 left out every token where sampler and re-scoring agree (rho 1): with --policy full all of them,
    # so the loss had no token and the weights never moved, as --veto 1e4 did
    with pytest.raises(ValueError) as error:
        cli.check_args(cli.parse_args(["--band", *band]))
    assert str(error.value) == ("--band LOW HIGH must hold rho 1, where sampler and re-scoring agree (Sparse-RL's 0.5 "
                                f"1.5), got {float(band[0])} {float(band[1])}")
    assert cli.check_args(cli.parse_args(["--band", "1", "2"])) is None


@pytest.mark.parametrize("argv", [["--policy", "full"], ["--eval-policies", "full"]])
def test_eval_budgets_with_only_the_full_cache_are_refused_not_ignored(argv):
    # evaluate.py --policy full --eval-budgets 8 12 printed the dense row alone: the budgets silently dropped
    with pytest.raises(ValueError) as error:
        cli.check_args(cli.parse_args(["--steps", "0", "--eval-budgets", "8", "12"] + argv))
    assert str(error.value) == ("--eval-budgets set the budgets of sparse caches, and every evaluated policy is full "
                                "(it keeps everything): name a sparse one in --eval-policies")
    assert cli.check_args(cli.parse_args(["--steps", "0", "--eval-budgets", "8", "--eval-policies", "full",
                                          "snapkv"])) is None


@pytest.mark.parametrize("argv, error", [
    (["--d", "x"], "ambiguous option: --d could match --data, --digits, --dense-layers, --downsample, --distill, "
                   "--distill-lambda, --device, --dtype"),
    (["--model"], "argument --model: expected one argument"),
])
def test_a_bad_command_line_is_told_by_the_full_parser_not_the_presets(argv, error, capsys):
    # the preset's parser (4 flags) said it first: "usage: train.py [--model MODEL] [--data DATA] [--device DEVICE]
    # [--task TASK]", as if those were every flag, and "--d could match --data, --device"
    with pytest.raises(SystemExit):
        cli.parse_args(argv)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].endswith("[--flag value ...]   (--help: every flag, with the value it will take)")
    assert err[1].endswith("error: " + error)


@pytest.mark.parametrize("argv", [
    ["--veto", "0.99"], ["--temperature", "1e-06"], ["--band", "0.5", "1"], ["--band", "1", "1.5"], ["--group-size", "2"],
    ["--digits", "1", "1"], ["--task", "sort", "--digits", "4", "8", "--max-new-tokens", "8"], ["--controller", "0"],
    ["--controller", "1"]])
def test_each_check_args_bound_admits_the_value_on_its_edge(argv):
    # Pins the edge of each bound, as its message says it: --veto < 1, a temperature of C.MIN_TEMPERATURE (1e-6) or
    # more, a band that holds rho 1 at either end, a group of 2, 1 <= MIN <= MAX digits, --max-new-tokens >= MAX, a
    # threshold in [0, 1]. Mutants that survived: '<= 1' for the veto, '<=' for the temperature, '1 < HIGH' for the
    # band, '<= 2' for the group, 'MIN < MAX' for the digits, '<=' for the toy answers, '0 <' or '< 1' for the controller
    assert cli.check_args(cli.parse_args(argv)) is None


@pytest.mark.parametrize("argv, message", [
    (["--veto", "1"], "--veto must be < 1 (a response with any rho below it leaves the loss; Sparse-RL's 1e-4), got 1.0"),
    (["--digits", "0", "3"], "--digits needs 1 <= MIN <= MAX, got [0, 3]"),
    (["--task", "sort", "--digits", "4", "8", "--max-new-tokens", "7"], "--max-new-tokens 7 cuts off the toy answers of "
     "up to 8 digits (--digits MAX), so no long answer can be right: give --max-new-tokens >= 8 (or a smaller --digits "
     "MAX)"),
    (["--controller", "-0.1"], "--controller THRESHOLD is a 5th-percentile acceptance in [0, 1] (Sparrow's 0.86), got "
     "-0.1"),
    # check_least's list by name (was: only some of them had a case): a flag dropped from it is refused by SparseConfig
    # or the sampler under another name, or not at all
    (["--window", "0"], "--window must be >= 1, got 0"), (["--interval", "0"], "--interval must be >= 1, got 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0")])
def test_each_check_args_bound_refuses_the_value_just_past_its_edge(argv, message):
    # the other side of the edges above: veto 1 (every response with a rho below 1 vetoed), 0 digits, an answer of 8
    # digits in 7 tokens, a negative threshold, and the three counts of at least 1
    with pytest.raises(ValueError) as error:
        cli.check_args(cli.parse_args(argv))
    assert str(error.value) == message
