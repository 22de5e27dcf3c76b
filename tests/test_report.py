"""report.py runs: the tables of hand-written run folders against numbers computed by hand, the errors, and
--robust-budgets on a tiny trained run (its budgets reproduce the run's own final evaluations)."""
import argparse
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

import distill
import models
import report
import train
from evaluate import accuracy, eval_rewards
from kvcache import SparseConfig
from sampler import generate
from tasks import encode_prompt, held_out_examples, numeric_reward
from test_train import SMALL

REPO = Path(__file__).resolve().parents[1]


def line(step, tokens, dropped, vetoed, peak, dense, times, tails, reward=0.5):
    """One metrics.jsonl line with the keys report.py reads (times: rollout_s, scoring_s, update_s)."""
    return dict(step=step, reward=reward, accuracy=reward, tokens=tokens, dropped_tokens=dropped, vetoed=vetoed,
                peak_kv_bytes=peak, dense_kv_bytes=dense, rollout_s=times[0], scoring_s=times[1], update_s=times[2],
                alpha_p05=0.5, bin_size=16, tokens_by_bin=[9] * len(tails), alpha_p05_by_bin=tails,
                budget_by_bin=[24] * len(tails))


def logged(step):
    """One whole metrics.jsonl line of `step`, as text."""
    return json.dumps(line(step, 100, 0, 0, 1, 1, (1, 0, 0), [1.0]))


def write_run(folder, metrics, evals):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (folder / "eval.jsonl").write_text("".join(json.dumps(dict(step=s, dense=d, sparse=p)) + "\n" for s, d, p in evals))
    return str(folder)


@pytest.fixture
def runs(tmp_path):
    """grpo (the baseline) and pods with two seeds each, naive with one; given in the order grpo, pods, naive."""
    flat = lambda seconds: [line(s, 100, 0, 0, 100, 100, (seconds, 0, 0), [1.0], reward=0.1 * s) for s in (1, 2, 3)]
    return [
        write_run(tmp_path / "grpo-s0", [line(1, 100, 10, 1, 50, 100, (1, .5, .5), [1.0, 0.8, None]),
                                         line(2, 100, 0, 0, 30, 60, (1, 1, 1), [0.9, 0.6]),
                                         line(3, 200, 30, 2, 40, 100, (2, 0, 0), [1.0, 0.7, 0.2])],
                  [(0, .5, .3), (2, .7, .4), (3, .6, .5)]),
        write_run(tmp_path / "grpo-s1", [line(1, 100, 30, 0, 60, 100, (1, 1, 1), [0.8, None, 0.4]),
                                         line(2, 100, 0, 1, 60, 100, (1, .5, .5), [1.0, 0.5]),
                                         line(3, 600, 0, 0, 30, 100, (4, 0, 0), [0.9])],
                  [(0, .5, .3), (2, .5, .2), (3, .8, .3)]),
        write_run(tmp_path / "pods-s1", flat(3), [(0, .5, .5), (2, .6, .4), (3, .7, .5)]),
        write_run(tmp_path / "pods-s0", flat(1), [(0, .5, .5), (2, .8, .6), (3, .9, .7)]),
        write_run(tmp_path / "naive-s0", [line(s, 100, 5, 0, 25, 100, (1, 1, 1), [0.5, 0.4]) for s in (1, 2, 3)],
                  [(0, .5, .3), (2, .6, .2), (3, .65, .1)]),
    ]


def tables(text):
    """The markdown tables of the report, each as {first cell: the other cells}, header under 'variant'."""
    found, rows = [], None
    for row in text.splitlines() + [""]:
        if row.startswith("|") and not row.startswith("|---"):
            cells = [c.strip() for c in row.strip("|").split("|")]
            rows = rows if rows is not None else {}
            rows[cells[0]] = cells[1:]
        elif not row.startswith("|") and rows is not None:
            found, rows = found + [rows], None
    return found


def test_the_tables_hold_the_hand_computed_numbers(runs, tmp_path, capsys):
    report.main(["runs", *runs, "--out", str(tmp_path / "out" / "cmp")])
    text = capsys.readouterr().out
    comparison, tail, pods = tables(text)
    assert list(comparison) == ["variant", "grpo", "pods", "naive"]          # the order given, not sorted
    assert comparison["variant"] == ["seeds", "steps", "dense before RL", "sparse before RL", "dense", "sparse",
                                     "dense gain", "of grpo's gain", "peak KV vs dense", "dropped tokens", "vetoed",
                                     "train time (s)", "s/step", "sampling", "re-scoring", "update"]
    # grpo: final dense 0.6, 0.8 -> 0.7 ± sqrt(0.02) = 0.141; KV (0.5 + 0.5 + 0.4) / 3 and (0.6 + 0.6 + 0.3) / 3
    # -> 48.3 %; rejected 40/400 and 30/800 -> 6.9 %; vetoed 3 and 1; seconds 2 + 3 + 2 and 3 + 2 + 4 -> 8.
    # Gains: grpo 0.1 and 0.3 (mean 0.2), pods 0.2 and 0.4 (0.3: 150 % of grpo's), naive 0.15 (75 %).
    # Per step, mean over steps then seeds: grpo s/step 7/3 and 9/3 -> 2.67; sampling (1 + 1 + 2) / 3 and
    # (1 + 1 + 4) / 3 -> 1.67; re-scoring (.5 + 1 + 0) / 3 and (1 + .5 + 0) / 3 -> 0.50; update the same.
    # pods: 3 and 1 s of sampling a step -> 2.00, nothing else; naive: 1 + 1 + 1 a step.
    assert comparison["grpo"] == ["2", "3", "0.500 ± 0.000", "0.300 ± 0.000", "0.700 ± 0.141", "0.400 ± 0.141",
                                  "0.200 ± 0.141", "100%", "48.3%", "6.9%", "2.0", "8", "2.67", "1.67", "0.50", "0.50"]
    assert comparison["pods"] == ["2", "3", "0.500 ± 0.000", "0.500 ± 0.000", "0.800 ± 0.141", "0.600 ± 0.141",
                                  "0.300 ± 0.141", "150%", "100.0%", "0.0%", "0.0", "6", "2.00", "2.00", "0.00", "0.00"]
    assert comparison["naive"] == ["1", "3", "0.500", "0.300", "0.650", "0.100", "0.150", "75%", "25.0%", "5.0%",
                                   "0.0", "9", "3.00", "1.00", "1.00", "1.00"]           # one seed: no spread
    # bin 0-15: (1 + .9 + 1 + .8 + 1 + .9) / 6; 16-31: (.8 + .6 + .7 + .5) / 4; 32-47: (.2 + .4) / 2
    assert tail == {"variant": ["0-15", "16-31", "32-47"], "grpo": ["0.933", "0.650", "0.300"],
                    "pods": ["1.000", "-", "-"], "naive": ["0.500", "0.400", "-"]}
    # grpo's best after step 0: (0.6 + 0.8) / 2 at step 3, after 8 s; pods reaches it at step 2, after (2 + 6) / 2 s
    assert "reaches grpo's best, 0.700 (step 0: 0.500)" in text
    assert pods == {"variant": ["first step", "train time (s)", "speed-up vs grpo"], "grpo": ["3", "8", "1.00x"],
                    "pods": ["2", "4", "2.00x"], "naive": ["never", "-", "-"]}
    assert (tmp_path / "out" / "cmp.md").read_text() == text


def test_plots_are_written_with_matplotlib(runs, tmp_path):
    pytest.importorskip("matplotlib")
    report.main(["runs", *runs, "--out", str(tmp_path / "with")])
    for name in ("reward", "accuracy", "tail"):
        assert (tmp_path / f"with_{name}.png").read_bytes()[:4] == b"\x89PNG"


def test_without_matplotlib_each_png_asked_for_is_named_in_one_warning_line(runs, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)                  # import matplotlib now fails
    report.main(["runs", *runs, "--out", str(tmp_path / "without")])
    assert sorted(p.name for p in tmp_path.glob("without*")) == ["without.md"]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: matplotlib is not installed")
    assert all(f"without_{name}.png" in err[0] for name in ("reward", "accuracy", "tail"))


def test_reaching_the_baseline_counts_evaluations_after_step_0_only():
    # the baseline lost accuracy in training (0.9 at step 0, 0.7 at best): the race is to 0.7, and nobody wins at step 0
    steps = [line(s, 100, 0, 0, 1, 1, (1, 0, 0), [1.0]) for s in (1, 2)]
    evals = lambda *dense: [dict(step=s, dense=d, sparse=d) for s, d in enumerate(dense)]
    groups = {"base": [(steps, evals(0.9, 0.6, 0.7))], "other": [(steps, evals(0.9, 0.8, 0.5))]}
    assert report.reach_rows(groups) == (0.7, 0.9, [("base", 2, 2.0, 1.0), ("other", 1, 1.0, 2.0)])


def test_reaching_a_best_of_0_or_a_best_a_float_rounding_above_the_variants_mean():
    # Pins reach_rows' edges: a baseline whose best after step 0 is 0.0 still gets its table (`if not best` would
    # drop it), and a variant at 0.15 reaches the mean of 0.1 and 0.2, 0.15000000000000002 (the 1e-9 tolerance)
    steps = [line(s, 100, 0, 0, 1, 1, (1, 0, 0), [1.0]) for s in (1, 2)]
    evals = lambda *dense: [dict(step=s, dense=d, sparse=d) for s, d in enumerate(dense)]
    zero = {"base": [(steps, evals(0.5, 0.0, 0.0))], "other": [(steps, evals(0.5, 0.0, 0.0))]}
    assert report.reach_rows(zero) == (0.0, 0.5, [("base", 1, 1.0, 1.0), ("other", 1, 1.0, 1.0)])
    seeds = {"base": [(steps, evals(0.0, 0.0, 0.1)), (steps, evals(0.0, 0.0, 0.2))],
             "other": [(steps, evals(0.0, 0.15))]}
    assert report.reach_rows(seeds)[2] == [("base", 2, 2.0, 1.0), ("other", 1, 1.0, 2.0)]


def test_per_step_columns_average_each_seed_over_its_own_steps_first(tmp_path):
    # Pins comparison_rows' per_step (mean over steps, then over seeds): a seed of 1 step at 4 s and one of
    # 3 steps at 1 s give s/step (4 + 1) / 2 = 2.50, and peak KV (0.9 + 0.1) / 2 = 50.0 %; pooling the four
    # steps would give 1.75 and 30.0 %
    one = [line(1, 100, 0, 0, 90, 100, (4, 0, 0), [1.0])]
    three = [line(s, 100, 0, 0, 10, 100, (1, 0, 0), [1.0]) for s in (1, 2, 3)]
    groups = {"v": [report.read_run(write_run(tmp_path / f"v-s{i}", m, [(0, .5, .5), (3, .6, .6)]))
                    for i, m in enumerate((one, three))]}
    row = report.comparison_rows(groups)[0]
    assert row[9] == "50.0%" and row[13] == "2.50"


def test_running_mean_and_variant_names():
    assert report.running_mean([1, 2, 3, 4], k=2).tolist() == [1.0, 1.5, 2.5, 3.5]
    assert report.variant_of("results/runs/sparse-rl-s12/") == "sparse-rl" and report.variant_of("out") == "out"


@pytest.mark.parametrize("extra, message", [
    (["--robust-budgets", "0"], "--robust-budgets must be >= 1, got 0"),
    (["--robust-budgets", "8"], "grpo-s0' holds no checkpoint step-NNNNNN with args.json"),
    (["NOT-A-RUN"], "'.*NOT-A-RUN' is not a train.py run folder: it holds no metrics.jsonl"),
    (["STEPLESS"], "STEPLESS/metrics.jsonl line 2 has no \"step\" \\(a whole number\\): not a train.py log"),
    # other JSON lines: was a KeyError traceback, after --robust-budgets had loaded and evaluated every final model
    (["LACKING", "--robust-budgets", "8"], "LACKING/eval.jsonl line 2 has no 'sparse': not a train.py log"),
    (["TWICE"], "the run folders '.*grpo-s0' and '.*grpo-s0/' share a name"),   # it would count as a second seed
    # was one row "grpo" of 3 seeds: two seed-0 runs (here a toy's and, say, a GPU run's) averaged as if seeds
    (["ELSEWHERE"], "the run folders '.*grpo-s0' and '.*ELSEWHERE/grpo-s0' share a name: each is one seed"),
])
def test_bad_input_is_one_clear_line_before_any_model_is_loaded(runs, tmp_path, monkeypatch, extra, message):
    (tmp_path / "NOT-A-RUN").mkdir()
    (tmp_path / "STEPLESS").mkdir()
    (tmp_path / "STEPLESS" / "metrics.jsonl").write_text(f'{logged(1)}\n{{"reward": 0.5}}\n{{"ste')
    (tmp_path / "STEPLESS" / "eval.jsonl").write_text('{"step": 0, "dense": 0.5}\n')
    write_run(tmp_path / "LACKING", [line(1, 100, 0, 0, 1, 1, (1, 0, 0), [1.0])], [(0, .5, .5)])
    (tmp_path / "LACKING" / "eval.jsonl").write_text('{"step": 0, "dense": 0.5, "sparse": 0.5}\n'
                                                     '{"step": 1, "dense": 0.6}\n')
    named = dict(TWICE=runs[0] + "/", ELSEWHERE=write_run(tmp_path / "ELSEWHERE" / "grpo-s0",
                                                           [line(1, 100, 0, 0, 1, 1, (1, 0, 0), [1.0])], [(0, .5, .5)]))
    extra = [named.get(e, str(tmp_path / e)) if e.isupper() else e for e in extra]
    monkeypatch.setattr(report, "load_pretrained", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit, match=message) as exit_info:
        report.main(["runs", *runs, *extra, "--out", str(tmp_path / "r")])
    assert str(exit_info.value).startswith("error: ") and "\n" not in str(exit_info.value)
    assert not (tmp_path / "r.md").exists()


def test_no_run_folder_is_an_error():
    with pytest.raises(SystemExit, match="^error: no run folders given$"):
        report.main(["runs", "--out", "x"])


def test_a_dense_trained_run_is_tested_under_its_snapkv_settings(tmp_path):
    ckpt = tmp_path / "dense-s0" / "step-000003"
    ckpt.mkdir(parents=True)
    (ckpt / "args.json").write_text(json.dumps(vars(train.parse_args(["--policy", "full", "--window", "3"]))))
    _, args, configs = report.robust_plan(tmp_path / "dense-s0", 3, [20, 12])
    toy = dict(page_size=4, dense_layers=1)                                    # toy: interval 4, sink 2, pages of 4
    assert configs == [SparseConfig("snapkv", 20, 4, 3, 2, **toy), SparseConfig("snapkv", 12, 4, 3, 2, **toy)]
    with pytest.raises(ValueError, match="step-000003, is not its final step 5"):
        report.robust_plan(tmp_path / "dense-s0", 5, [20])
    with pytest.raises(ValueError, match="^--robust-budgets for .*dense-s0': the evaluation cache snapkv at budget 4: "
                                         "budget=4 must be >= window \\+ sink = 3 \\+ 2$"):
        report.robust_plan(str(tmp_path / "dense-s0"), 3, [20, 4])


def test_a_run_whose_data_file_is_gone_is_named_before_any_model_is_loaded(tmp_path):
    ckpt = tmp_path / "real-s0" / "step-000003"
    ckpt.mkdir(parents=True)
    argv = ["--model", "m", "--data", str(tmp_path / "gone.jsonl")]
    (ckpt / "args.json").write_text(json.dumps(vars(train.parse_args(argv))))
    with pytest.raises(ValueError, match="was trained on '.*gone.jsonl', which is not there"):
        report.robust_plan(tmp_path / "real-s0", 3, [20])


@pytest.mark.parametrize("argv, message", [
    (["--adapter", "no-such.safetensors"], "--adapter 'no-such.safetensors': no such file"),
    (["--adapter", ""], "--adapter is empty: give a value, or leave the flag out"),   # was: no adapter, silently
])
def test_inference_refuses_bad_flags_before_loading(tmp_path, monkeypatch, argv, message):
    (tmp_path / "q.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    monkeypatch.setattr(report, "load_pretrained", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit, match=message):
        report.main(["inference", *argv, "--model", str(tmp_path), "--data", str(tmp_path / "q.jsonl")])


def test_runs_refuses_an_empty_out_prefix_or_one_without_a_name(tmp_path):
    with pytest.raises(SystemExit, match="^error: --out is empty: give a value, or leave the flag out$"):   # was: ./.md
        report.main(["runs", "no-such-run", "--out", ""])
    with pytest.raises(SystemExit, match="is a folder; give a file name prefix$"):   # was: <folder>/new/.md
        report.main(["runs", "no-such-run", "--out", f"{tmp_path}/new/"])
    assert not (tmp_path / "new").exists()
    # a prefix beside a folder of its name is fine (--out results/runs-gpu writes results/runs-gpu.md): on to the runs
    with pytest.raises(SystemExit, match="no-such-run"):
        report.main(["runs", str(tmp_path / "no-such-run"), "--out", str(tmp_path)])


def test_a_huge_limit_or_budget_passes_the_checks(tmp_path, monkeypatch):
    # --limit past the file reads it all and a budget up to DENSE = 2**40 never evicts: no 2**31 bound for these
    (tmp_path / "q.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    monkeypatch.setattr(report, "load_pretrained", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(pytest.fail.Exception, match="a model was loaded"):
        report.main(["inference", "--data", str(tmp_path / "q.jsonl"), "--limit", str(2 ** 40), "--budgets",
                     str(2 ** 40)])


@pytest.mark.parametrize("flags, message", [
    (["--interval", "0", "--batch-size", "-1"], "--interval must be >= 1, got 0$"),    # the first bad one, in order
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0$"),
    (["--max-new-tokens", "-2", "--limit", "0"], "--limit must be >= 1, got 0$"),
    (["--budgets", "64", "0"], "--budgets must be >= 1, got 0$"),
])
def test_inference_names_its_first_bad_count_before_loading(tmp_path, monkeypatch, flags, message):
    # Pins inference's `bad` check: each of the four counts is checked, and the message names the first bad one
    # (limit, max_new_tokens, interval, batch_size) with its value; bad[-1] or a dropped name fails here
    (tmp_path / "q.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    monkeypatch.setattr(report, "load_pretrained", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit, match=f"^error: {message}"):
        report.main(["inference", "--data", str(tmp_path / "q.jsonl"), *flags])


def test_robust_budgets_name_the_first_bad_budget(runs, tmp_path):
    # Pins runs' `bad` check: the first budget below 1 is named (bad[-1] would say -3)
    with pytest.raises(SystemExit, match="^error: --robust-budgets must be >= 1, got 0$"):
        report.main(["runs", *runs, "--robust-budgets", "8", "0", "-3", "--out", str(tmp_path / "r")])


@pytest.mark.parametrize("flags", [[], ["--dtype", "bfloat16", "--eval-size", "256"],
                                   ["--steps", "3", "--distill", "kl", "--lora-lr-scale", "300"]],
                         ids=["fp32", "bf16", "distill"])
def test_robust_budgets_reproduce_the_runs_own_final_evaluations(tmp_path, capsys, flags):
    # A 1-step run (60 warm-up steps: dense 0.438, sparse 0.344 here; 4 s). At its training budget (SnapKV 10) the
    # final model must score what train.py's own final sparse evaluation wrote; at 64, more than any context here,
    # what the dense one wrote. As train.py evaluates: bf16 as fp32 weights under autocast (bf16 weights: 0.293,
    # not 0.289). A DistillSparse run's model is theta alone, as README's distill table reads *sparse @ 12* ("the
    # same policies without it"): its adapter is the sparse column's sampler (0.312 with it here, 0.344 without)
    folder = tmp_path / "tiny-s0"
    train.main(SMALL + ["--warmup-steps", "60", "--steps", "1", "--out", str(folder), *flags])
    final = json.loads((folder / "eval.jsonl").read_text().splitlines()[-1])
    assert final["dense"] != final["sparse"]                                # else the check below proves little
    sparse = final["sparse"]
    if "--distill" in flags:   # theta alone at budget 10: train.py's evaluate-only run of the checkpoint, no adapter
        _, alone = train.main(SMALL + ["--warmup-steps", "60", "--out", str(folder), "--steps", "0", "--resume",
                                       "--eval-budgets", "10"])
        sparse = alone["snapkv, budget 10"]
        assert sparse != final["sparse"]                                     # the adapter changes the answers
    capsys.readouterr()
    report.main(["runs", str(folder), "--robust-budgets", "10", "64", "--out", str(tmp_path / "r")])
    comparison = tables(capsys.readouterr().out)[0]
    assert comparison["variant"][8:10] == ["sparse @ 10", "sparse @ 64"]
    assert comparison["tiny"][8:10] == [f"{sparse:.3f}", f"{final['dense']:.3f}"]                  # one seed


def test_no_share_of_a_gain_within_the_noise(tmp_path):
    # the baseline's gains +0.1 and -0.05 (mean 0.025, std 0.106): a share of it would be a ratio to noise
    evals = lambda after: [(0, .5, .5), (3, after, after)]
    steps = [line(s, 100, 0, 0, 1, 1, (1, 0, 0), [1.0]) for s in (1, 2, 3)]
    groups = {"base": [report.read_run(write_run(tmp_path / f"base-s{i}", steps, evals(a)))
                       for i, a in enumerate((.6, .45))],
              "other": [report.read_run(write_run(tmp_path / "other-s0", steps, evals(.7)))]}
    rows = {r[0]: r for r in report.comparison_rows(groups)}
    assert rows["base"][8] == "-" and rows["other"][8] == "-"
    assert rows["other"][7] == "0.200"


def test_inference_runs_the_first_limit_questions_and_compares_each_row_to_the_dense_one(tmp_path, monkeypatch, capsys):
    # no model: run_inference stubbed, its peak KV set by hand (dense 10 MiB; snapkv budget/8 MiB, h2o 1.5x that)
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps(dict(prompt=f"{i} + 1 =", answer=str(i + 1))) + "\n" for i in range(5)))
    monkeypatch.setattr(report, "load_pretrained", lambda *a, **k: ("model", "tokenizer"))
    calls, handed = [], []

    def run_inference(model, tokenizer, examples, reward, sparse, max_new_tokens, batch_size, adapter):
        calls.append((sparse.policy, None if sparse.policy == "full" else sparse.budget, [e["prompt"] for e in examples]))
        handed.append((sparse, reward, max_new_tokens, batch_size, adapter))
        mib = 10 if sparse.policy == "full" else sparse.budget / 8 * (1.5 if sparse.policy == "h2o" else 1)
        return dict(accuracy=len(calls) / 10, peak_kv_bytes=int(mib * 2**20), alpha_mean=1 - len(calls) / 100,
                    alpha_p05=0.5, tokens=10 * len(examples), seconds=2.0)
    monkeypatch.setattr(report, "run_inference", run_inference)
    report.main(["inference", "--data", str(data), "--limit", "3", "--policies", "snapkv", "h2o",
                 "--budgets", "8", "16", "--interval", "4", "--window", "3", "--sink", "2", "--batch-size", "5"])
    text = capsys.readouterr().out
    first3 = ["0 + 1 =", "1 + 1 =", "2 + 1 ="]                                # --limit 3: three, the first three
    assert calls == [("full", None, first3)] + [(p, b, first3) for b in (8, 16) for p in ("snapkv", "h2o")]
    # each cache whole (interval 4, window 3, sink 2: a window and sink swapped showed nothing at 2 and 2), the
    # numeric reward of the --data answers, 256 new tokens, --batch-size, no adapter. Mutants caught: window and
    # sink swapped in inference's SparseConfig, exact_match handed for numeric_reward
    assert handed == [(c, numeric_reward, 256, 5, None) for c in [SparseConfig("full")] + [
        SparseConfig(p, b, 4, 3, 2) for b in (8, 16) for p in ("snapkv", "h2o")]]
    assert "interval 4, window 3, sink 2; peak KV summed over batches of 5" in text
    assert f"3 questions of {data}, greedy, 256 new tokens" in text
    rows = [[c.strip() for c in row.strip("|").split("|")] for row in text.splitlines()
            if row.startswith("| ") and not row.startswith("| rollout")]
    # rollout, budget, accuracy, peak MiB, vs dense (of dense's 10 MiB), alpha mean, p05, tokens, seconds
    assert rows == [["dense", "-", "0.10", "10.0", "100%", "0.990", "0.500", "30", "2"],
                    ["snapkv", "8", "0.20", "1.0", "10%", "0.980", "0.500", "30", "2"],
                    ["h2o", "8", "0.30", "1.5", "15%", "0.970", "0.500", "30", "2"],
                    ["snapkv", "16", "0.40", "2.0", "20%", "0.960", "0.500", "30", "2"],
                    ["h2o", "16", "0.50", "3.0", "30%", "0.950", "0.500", "30", "2"]]


def test_a_repeated_step_keeps_its_last_line(tmp_path):
    # a resumed run wrote steps 2 and 3 again (and its evaluation at 2): the rewritten lines count, in step order
    metrics = [line(s, 100, 0, 0, 1, 1, (1, 0, 0), [1.0], reward=r) for s, r in ((1, .1), (2, .2), (3, .3), (2, .4), (3, .5))]
    folder = write_run(tmp_path / "resumed-s0", metrics, [(0, .5, .5), (2, .6, .6), (2, .7, .1)])
    metrics, evals = report.read_run(folder)
    assert [(m["step"], m["reward"]) for m in metrics] == [(1, .1), (2, .4), (3, .5)]
    assert evals == [dict(step=0, dense=.5, sparse=.5), dict(step=2, dense=.7, sparse=.1)]


@pytest.mark.parametrize("text, message", [
    (f'{logged(1)}\n{{"step": 2, oops\n{{"step": 3, "rew', "metrics.jsonl line 2 is not JSON: Expecting"),   # not last
    ("\n  \n", "metrics.jsonl is empty"),                                                    # blank lines only
    (f'{logged(1)}\n5\n{{"reward": 1}}\n', 'metrics.jsonl line 2 has no "step"'),          # the first stepless one
    (f'{logged(1)}\n{{"step": "2"}}\n', 'metrics.jsonl line 2 has no "step" \\(a whole number\\)'),   # was a TypeError
    ('{"step": 1, "reward": 1}\n', "metrics.jsonl line 1 has no 'tokens': not a train.py log"),       # was a KeyError
    # the file's own line numbers, blank lines counted: were "line 2" and "line 1 column 13" (json's, of the line alone)
    (f'{logged(1)}\n\n\n{{"reward": 1}}\n{logged(2)}\n', 'metrics.jsonl line 4 has no "step"'),
    (f'{logged(1)}\n\n{{"step": 2, oops\n{logged(3)}\n', "metrics.jsonl line 3 is not JSON: Expecting property"),
], ids=["bad-json", "blank", "not-an-object", "step-a-string", "no-tokens", "blanks-count", "bad-json-after-blank"])
def test_read_run_forgives_a_half_written_last_line_only(tmp_path, text, message):
    # Pins read_run's rules: only the last line may fail to parse (a killed run's), a file of blank lines is empty,
    # a line that is not an object counts as stepless, and the first bad line is named by its line in the file;
    # blank lines between records are skipped. Forgiving the line before the last too, or any bad line, or none,
    # fails this.
    folder = write_run(tmp_path / "r-s0", [], [(0, .5, .5)])
    (tmp_path / "r-s0" / "metrics.jsonl").write_text(text)
    with pytest.raises(ValueError, match=message):
        report.read_run(folder)
    (tmp_path / "r-s0" / "metrics.jsonl").write_text(f'{logged(1)}\n\n   \n{logged(2)}\n{{"step": 3, "re')
    assert [m["step"] for m in report.read_run(folder)[0]] == [1, 2]


def test_seeds_that_end_at_different_steps_are_shown_and_said(tmp_path):
    # one seed cut short by a time limit at step 2, the others reached step 5: "2-5" (a mean, 4, would hide it)
    steps = lambda last: [line(s, 100, 0, 0, 1, 1, (1, 0, 0), [1.0]) for s in range(1, last + 1)]
    groups = {"v": [report.read_run(write_run(tmp_path / f"v-s{i}", steps(last), [(0, .5, .5), (last, .6, .6)]))
                    for i, last in enumerate((2, 5, 5))],
              "w": [report.read_run(write_run(tmp_path / f"w-s{i}", steps(5), [(0, .5, .5), (5, .6, .6)]))
                    for i in (0, 1)]}
    assert [row[:3] for row in report.comparison_rows(groups)] == [["v", 3, "2-5"], ["w", 2, "5"]]
    notes = [l for l in report.report_text(groups).splitlines() if l.startswith("Note:")]
    assert notes == ["Note: the seeds of v end at different steps (2, 5; a run cut short ends early), so its 'after' "
                     "columns, vetoed and train time average runs of different lengths, and its accuracy curve and "
                     "time to the baseline's best stop at step 2, where the shortest ends."]


def test_the_mean_curve_averages_the_steps_every_seed_logged():
    # seed 0 evaluated at 0, 2, 3 and seed 1 at 0, 2, 4: only 0 and 2 have both seeds behind their mean
    seeds = [[dict(step=s, dense=d) for s, d in zip((0, 2, 3), (.5, .6, .9))],
             [dict(step=s, dense=d) for s, d in zip((0, 2, 4), (.3, .8, .1))]]
    assert report.mean_curve(seeds, "dense") == [(0, pytest.approx(.4)), (2, pytest.approx(.7))]


def test_first_last_steps_span_the_earliest_and_latest_of_three_seeds(tmp_path):
    # Pins last_steps (sorted) and the "first-last" cell: seeds given ending at 10, 3 and 5 span "3-10" (not
    # "3-5", the two smallest, nor "10-5", the set's own order), and the note lists them in order
    steps = [line(s, 100, 0, 0, 1, 1, (1, 0, 0), [1.0]) for s in (1, 2)]
    groups = {"v": [report.read_run(write_run(tmp_path / f"v-s{i}", steps, [(0, .5, .5), (last, .6, .6)]))
                    for i, last in enumerate((10, 3, 5))]}
    assert report.comparison_rows(groups)[0][:3] == ["v", 3, "3-10"]
    assert "the seeds of v end at different steps (3, 5, 10;" in report.report_text(groups)


def test_a_variant_name_may_hold_an_s_and_digits_before_its_seed():
    # Pins variant_of's anchor: only the trailing -s<seed> goes; "h2o-s64" (a budget in the name) stays whole
    assert report.variant_of("results/runs/h2o-s64-s1") == "h2o-s64"


def test_the_tail_bins_come_in_context_order_for_the_plot():
    # Pins tail_by_variant's sorted bins (the tail plot draws them as a line in this order): a first step with no
    # tokens in bin 0 puts bin 16-31 first in the pool; the curve must still run 0-15, 16-31
    metrics = [dict(bin_size=16, alpha_p05_by_bin=[None, 0.5]), dict(bin_size=16, alpha_p05_by_bin=[0.7, 0.3])]
    tails = report.tail_by_variant({"v": [(metrics, None)]})["v"]
    assert list(tails.items()) == [((0, 15), 0.7), ((16, 31), pytest.approx(0.4))]


@pytest.mark.parametrize("text, message", [
    ("{oops", "cannot read {path} (Expecting property name enclosed in double quotes: line 1 column 2 (char 1)): "
              "--robust-budgets needs the run's settings"),
    ("[1, 2]", "{path} holds a list, not a run's settings (a JSON object)")], ids=["not-json", "a-list"])
def test_a_damaged_args_json_is_one_line_naming_it(tmp_path, text, message):
    # a list was a TypeError traceback from dict.update; bad JSON a bare "error: Expecting property name ..."
    ckpt = tmp_path / "sparse-s0" / "step-000003"
    ckpt.mkdir(parents=True)
    (ckpt / "args.json").write_text(text)
    with pytest.raises(ValueError) as error:
        report.robust_plan(tmp_path / "sparse-s0", 3, [20])
    assert str(error.value) == message.format(path=ckpt / "args.json")


@pytest.mark.parametrize("command, required", [("inference", ["--data", "q.jsonl"]), ("runs", ["--out", "r"])])
def test_help_shows_the_value_each_flag_takes(command, required, capsys):
    # STYLE: `--help` shows the value each flag will take. argparse prints a default only beside a help text, so
    # inference's --max-new-tokens, --policies and --dtype and runs' --device showed none
    defaults = {k: v for k, v in vars(report.parse_args([command, *required])).items() if v not in (None, [], command)}
    with pytest.raises(SystemExit):
        report.parse_args([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())                  # argparse wraps its lines anywhere
    for name, value in defaults.items():
        if f"--{name.replace('_', '-')}" in required:
            continue
        assert f"(default: {value})" in text or f"{value} (the default)" in text, name


def test_a_distill_runs_adapter_step_counts_in_its_train_time(tmp_path):
    # a DistillSparse step logs the adapter's seconds apart (distill_s, after update_s): each of these 2 steps is
    # 1 + 1 + 1 + 3 = 6 s, so 12 s in all, update 4.00 a step, and 6 s to reach the baseline's 0.7 at step 2
    # against sparse-rl's 2 x 3 = 6 s: 0.50x. Without distill_s: 6 s, 3.00 and 1.00, 1.00x (as cheap as sparse-rl)
    evals = [(0, .5, .5), (2, .7, .7)]
    steps = lambda **extra: [{**line(s, 100, 0, 0, 1, 1, (1, 1, 1), [1.0]), **extra} for s in (1, 2)]
    groups = {"sparse-rl": [report.read_run(write_run(tmp_path / "sparse-rl-s0", steps(), evals))],
              "distill": [report.read_run(write_run(tmp_path / "distill-s0", steps(distill_s=3), evals))]}
    rows = {r[0]: r for r in report.comparison_rows(groups)}
    assert rows["sparse-rl"][-5:] == ["6", "3.00", "1.00", "1.00", "1.00"]
    assert rows["distill"][-5:] == ["12", "6.00", "1.00", "1.00", "4.00"]
    assert report.reach_rows(groups)[2] == [("sparse-rl", 2, 6.0, 1.0), ("distill", 2, 12.0, 0.5)]


@pytest.mark.parametrize("runs, code", [(["ok 0.1", "fail 0.3"], 1), (["ok 0.1", "ok 0.2", "ok 0.1"], 0)],
                         ids=["fail-unwaited", "all-ok"])
def test_reproduce_sh_queue_returns_the_failure_of_a_run_that_ended_unwaited(runs, code):
    # a run that ended after `wait -n` returned for its sibling, but before `jobs -rp` looked, was waited for by
    # no one: queue returned 0 and reproduce.sh went on past the failed run. A slow `wait` opens that window here;
    # all-ok: a run `wait -n` reaped already still waits as 0 (its status is kept), so no ok queue fails
    script = f"""set -euo pipefail
eval "$(sed -n '/^queue() {{/,/^}}/p' '{REPO / "reproduce.sh"}')"
run() {{ sleep "$2"; [ "$1" = ok ]; }}
wait() {{ local rc=0; builtin wait "$@" || rc=$?; sleep 0.5; return $rc; }}
queue {" ".join(f'"{r}"' for r in runs)}
echo "queue returned 0"
"""
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert (done.returncode, "queue returned 0" in done.stdout) == (code, code == 0), done.stderr


def test_gpu_smollm2_unpack_stops_at_a_damaged_tgz(tmp_path):
    # a truncated dense-s0.tgz (say, a fetch cut short) before a whole naive-s0.tgz: unpack exited 0, its status
    # that of the last file only, and `report` went on without dense or with half of its metrics.jsonl
    shutil.copy(REPO / "gpu_smollm2.sh", tmp_path)                      # it cds to its own folder
    back = tmp_path / "back"
    back.mkdir()
    for name in ("dense-s0", "naive-s0"):
        run = write_run(tmp_path / "made" / name, [line(1, 100, 0, 0, 1, 1, (1, 0, 0), [1.0])], [(0, .5, .5)])
        with tarfile.open(back / f"{name}.tgz", "w:gz") as tar:
            tar.add(run, arcname=name)
    whole = (back / "dense-s0.tgz").read_bytes()
    (back / "dense-s0.tgz").write_bytes(whole[: len(whole) // 2])
    done = subprocess.run(["bash", str(tmp_path / "gpu_smollm2.sh"), "unpack", "back"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == ("gpu_smollm2.sh: back/dense-s0.tgz did not unpack (tar's message above): "
                                            "results/runs-gpu/dense-s0 may be partial; fetch back/dense-s0.tgz again")


def test_reproduce_sh_budgets_names_a_killed_calibration_instead_of_a_half_empty_line(tmp_path):
    # a calibration killed before it wrote its schedule leaves a log with no "wrote" line: report printed
    # "<log>: ; stretched to 32K tokens:" with nothing after it, and schedule.py's usage error on the terminal
    (tmp_path / "calibrate-s0.log").write_text(f"the smallest constant budget holding 0.86 in every bin: 24\n"
                                               f"wrote {tmp_path}/s0.json\n")
    (tmp_path / "s0.json").write_text("{}")
    (tmp_path / "calibrate-s1.log").write_text("calibrate: budget 12 ...\n")                     # killed mid-way
    script = f"""set -euo pipefail
eval "$(sed -n '/^budgets() {{/,/^}}/p' '{REPO / "reproduce.sh"}')"
python() {{ echo "| stretched to 32K | 1.33x | 1.32x | 1.30x |"; }}   # schedule.py --speedup's row
OUT='{tmp_path}'
budgets
"""
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == (f"{tmp_path}/calibrate-s0.log: the smallest constant budget holding 0.86 in every bin: 24; "
                        "stretched to 32K tokens:  1.33x | 1.32x | 1.30x ")
    assert lines[1] == (f"{tmp_path}/calibrate-s1.log: no schedule written (unfinished or not run): rerun its "
                        "experiment (schedule or distill)")
    assert lines[2] == (f"{tmp_path}/calibrate-distill-s?-off.log: no schedule written (unfinished or not run): "
                        "rerun its experiment (schedule or distill)")                  # no distill calibration ran
    assert done.stderr == ""


def test_a_log_that_is_not_text_is_named(tmp_path):
    # a gzipped metrics.jsonl (say, fetched packed) was "error: 'utf-8' codec can't decode byte 0x8b in position 1:
    # invalid start byte", naming no file
    folder = write_run(tmp_path / "r-s0", [line(1, 100, 0, 0, 1, 1, (1, 0, 0), [1.0])], [(0, .5, .5)])
    (tmp_path / "r-s0" / "metrics.jsonl").write_bytes(b"\x1f\x8b\x08\x00packed")
    with pytest.raises(ValueError, match="^.*r-s0/metrics.jsonl is not text \\(UTF-8\\): byte 0x8b at position 1$"):
        report.read_run(folder)


def test_a_log_of_one_half_written_line_is_not_called_empty(tmp_path):
    # a run killed while writing its first metrics line: the file holds '{"step": 1, "rew' and was "... is empty"
    folder = write_run(tmp_path / "r-s0", [], [(0, .5, .5)])
    (tmp_path / "r-s0" / "metrics.jsonl").write_text('{"step": 1, "rew')
    with pytest.raises(ValueError, match="r-s0/metrics.jsonl holds no whole line: its only line, 1, is half written "
                                         "\\(not JSON\\)$"):
        report.read_run(folder)


def test_totals_count_the_steps_up_to_the_last_evaluation(tmp_path):
    # both seeds' 'after' is their evaluation at step 2; seed 1 was killed (gpu_smollm2.sh's time limit) after a
    # step 3 of 10 s and 4 vetoes, before its evaluation at 4. Train time and vetoed are what led to the 'after'
    # columns: 1 + 1 s and 0 vetoes in each seed -> "2", "0.0", no note (both end at 2). Counting step 3 gave
    # (2 + 12) / 2 = 7 s and 2.0 vetoes, beside the same 'after', and no note said the runs' lengths differ.
    # The per-step columns stay means over every logged step: (1 + (1 + 1 + 10) / 3) / 2 = 2.50 s a step.
    steps = [line(s, 100, 0, 0, 1, 1, (1, 0, 0), [1.0]) for s in (1, 2)]
    killed = steps + [line(3, 100, 0, 4, 1, 1, (10, 0, 0), [1.0])]
    groups = {"v": [report.read_run(write_run(tmp_path / f"v-s{i}", m, [(0, .5, .5), (2, .6, .6)]))
                    for i, m in enumerate((steps, killed))]}
    row = report.comparison_rows(groups)[0]
    assert row[2] == "2" and row[11:14] == ["0.0", "2", "2.50"]
    assert "Note:" not in report.report_text(groups)


def test_an_eval_log_without_its_step_0_evaluation_is_named(tmp_path):
    # 'before RL' and the dense gain read a run's first evaluation as step 0's (train.py writes it first): an
    # eval.jsonl cut to steps 2 and 3 printed step 2's 0.7 as "dense before RL" and a gain of 0.1, not 0.3
    folder = write_run(tmp_path / "r-s0", [line(s, 100, 0, 0, 1, 1, (1, 0, 0), [1.0]) for s in (1, 2, 3)],
                       [(2, .7, .7), (3, .8, .8)])
    with pytest.raises(ValueError, match="r-s0/eval.jsonl starts at step 2: it lacks the evaluation before RL, at "
                                         "step 0 \\(train.py writes it first\\)$"):
        report.read_run(folder)


def test_the_spread_is_the_sample_std_said_so_and_none_for_one_seed(runs, tmp_path, capsys):
    # grpo's final dense 0.6 and 0.8: sqrt(((0.1)^2 + (0.1)^2) / (2 - 1)) = 0.141 (n would give 0.100); the line
    # above the table says which. One seed has no spread: naive's 0.650 was printed "0.650 ± 0.000", a spread of 0
    report.main(["runs", *runs, "--out", str(tmp_path / "cmp")])
    text = capsys.readouterr().out
    comparison = tables(text)[0]
    assert comparison["grpo"][4] == "0.700 ± 0.141" and comparison["naive"][4] == "0.650"
    assert "mean ± sample std over seeds (divided by n - 1; a single seed's value alone)" in text


def test_metrics_missing_steps_before_the_last_evaluation_are_said(tmp_path):
    # seed 1's metrics.jsonl lost step 2 (its eval.jsonl goes on to 3): its train time is 2 s, not 3, and the
    # report said nothing; the note names the variant and counts the steps lacking
    steps = lambda *ss: [line(s, 100, 0, 0, 1, 1, (1, 0, 0), [1.0]) for s in ss]
    groups = {"v": [report.read_run(write_run(tmp_path / f"v-s{i}", m, [(0, .5, .5), (3, .6, .6)]))
                    for i, m in enumerate((steps(1, 2, 3), steps(1, 3)))]}
    notes = [l for l in report.report_text(groups).splitlines() if l.startswith("Note:")]
    assert notes == ["Note: 1 of the 2 seeds of v lack the metrics of 1 steps in all before their last evaluation, "
                     "so its vetoed, train time and time to the baseline's best count only the steps logged."]


def test_a_seed_cut_short_ends_the_variants_curve_and_race_where_it_ends_and_it_is_said(tmp_path):
    # base's seed 1 was cut short after its evaluation at 2; seed 0 went on to 0.9 at 4. The accuracy curve and
    # the PODS table read the mean over seeds at the steps both evaluated (0 and 2): best (0.6 + 0.7) / 2 = 0.65,
    # not 0.9, and nothing in the report said the race stopped at step 2
    steps = lambda last: [line(s, 100, 0, 0, 1, 1, (1, 0, 0), [1.0]) for s in range(1, last + 1)]
    evals = [(0, .5, .5), (2, .6, .6), (4, .9, .9)], [(0, .5, .5), (2, .7, .7)]
    groups = {"base": [report.read_run(write_run(tmp_path / f"base-s{i}", steps(e[-1][0]), e))
                       for i, e in enumerate(evals)]}
    assert report.reach_rows(groups)[0] == pytest.approx(0.65)
    assert ("so its 'after' columns, vetoed and train time average runs of different lengths, and its accuracy "
            "curve and time to the baseline's best stop at step 2, where the shortest ends."
            ) in report.report_text(groups)


def test_a_log_value_that_is_not_a_number_is_named(tmp_path):
    # an evaluation written as null (hand-edited, or another tool's log) passed read_run, and report.py runs ended
    # in a traceback from the table's format: "TypeError: unsupported format string passed to NoneType.__format__"
    folder = write_run(tmp_path / "r-s0", [line(s, 100, 0, 0, 1, 1, (1, 0, 0), [1.0]) for s in (1, 2)],
                       [(0, .5, .5), (2, None, .6)])
    with pytest.raises(ValueError, match="r-s0/eval.jsonl line 2: 'dense' is None, not a number: not a train.py log$"):
        report.read_run(folder)
    (tmp_path / "r-s0" / "eval.jsonl").write_text('{"step": 0, "dense": 0.5, "sparse": 0.5}\n'
                                                  '{"step": 2, "dense": 0.6, "sparse": true}\n')
    with pytest.raises(ValueError, match="eval.jsonl line 2: 'sparse' is True, not a number"):
        report.read_run(folder)


def test_inference_runs_a_policy_or_budget_named_twice_once(tmp_path, monkeypatch, capsys):
    # --policies snapkv snapkv --budgets 8 8 ran snapkv at 8 four times and printed four equal rows (evaluate.py's
    # --eval-budgets 8 8 was fixed the same way): one run and one row per (policy, budget), in the order named
    (tmp_path / "q.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    monkeypatch.setattr(report, "load_pretrained", lambda *a, **k: ("model", "tokenizer"))
    calls = []

    def run_inference(model, tokenizer, examples, reward, sparse, *rest):
        calls.append((sparse.policy, sparse.budget if sparse.policy != "full" else None))
        return dict(accuracy=1.0, peak_kv_bytes=2**20, alpha_mean=1.0, alpha_p05=1.0, tokens=1, seconds=1.0)
    monkeypatch.setattr(report, "run_inference", run_inference)
    report.main(["inference", "--data", str(tmp_path / "q.jsonl"), "--policies", "snapkv", "h2o", "snapkv",
                 "--budgets", "8", "8", "--interval", "4", "--window", "2", "--sink", "2"])
    assert calls == [("full", None), ("snapkv", 8), ("h2o", 8)]
    assert len([r for r in capsys.readouterr().out.splitlines() if r.startswith("| snapkv |")]) == 1


def test_a_robust_budget_named_twice_is_evaluated_once(runs, tmp_path, monkeypatch, capsys):
    # --robust-budgets 12 12 evaluated every final model twice at 12 and printed two equal "sparse @ 12" columns
    planned = []
    monkeypatch.setattr(report, "robust_plan",
                        lambda folder, step, budgets: (planned.append(budgets), None, budgets)[1:])
    monkeypatch.setattr(report, "robust_accuracy", lambda ckpt, budgets, device: [0.5] * len(budgets))
    report.main(["runs", *runs, "--robust-budgets", "12", "10", "12", "--out", str(tmp_path / "r")])
    assert planned == [[12, 10]] * len(runs)
    assert tables(capsys.readouterr().out)[0]["variant"][8:11] == ["sparse @ 12", "sparse @ 10", "peak KV vs dense"]


def test_a_single_seed_baseline_still_gets_shares_and_three_seeds_are_means(tmp_path):
    # Pins mean_std: a single seed's std is 0, not nan (a nan std made `first > std` false, so every "of base's
    # gain" cell of a one-seed baseline was "-"), and the mean is a mean, not a median: other's three seeds end
    # at 0.6, 0.6, 0.9 -> 0.700 ± sqrt((0.01 + 0.01 + 0.04) / 2) = 0.173 (median 0.600), gains 0.1, 0.1, 0.4 ->
    # 0.200, 100 % of base's one-seed 0.2 (a median gain would be 50 %)
    steps = [line(s, 100, 0, 0, 1, 1, (1, 0, 0), [1.0]) for s in (1, 2, 3)]
    evals = lambda after: [(0, .5, .5), (3, after, after)]
    groups = {"base": [report.read_run(write_run(tmp_path / "base-s0", steps, evals(.7)))],
              "other": [report.read_run(write_run(tmp_path / f"other-s{i}", steps, evals(a)))
                        for i, a in enumerate((.6, .6, .9))]}
    rows = {r[0]: r for r in report.comparison_rows(groups)}
    assert rows["base"][5:9] == ["0.700", "0.700", "0.200", "100%"]
    assert rows["other"][5:9] == ["0.700 ± 0.173", "0.700 ± 0.173", "0.200 ± 0.173", "100%"]


def test_no_share_of_a_baseline_that_lost_accuracy(tmp_path):
    # Pins `first > std` against abs(first): base's gains -0.2 and -0.3 (mean -0.25, std 0.071) are beyond the
    # noise but a loss; "of base's gain" would read other's +0.2 as -80 %, so both cells are "-"
    steps = [line(s, 100, 0, 0, 1, 1, (1, 0, 0), [1.0]) for s in (1, 2, 3)]
    evals = lambda after: [(0, .5, .5), (3, after, after)]
    groups = {"base": [report.read_run(write_run(tmp_path / f"base-s{i}", steps, evals(a)))
                       for i, a in enumerate((.3, .2))],
              "other": [report.read_run(write_run(tmp_path / "other-s0", steps, evals(.7)))]}
    rows = {r[0]: r for r in report.comparison_rows(groups)}
    assert rows["base"][7:9] == ["-0.250 ± 0.071", "-"] and rows["other"][7:9] == ["0.200", "-"]


def test_robust_columns_are_each_budgets_mean_over_seeds(runs, tmp_path, monkeypatch, capsys):
    # Pins comparison_rows' zip(*robust[variant]): one column per budget, each the mean ± sample std over the
    # variant's seeds. grpo's seeds score (0.1 at 12, 0.5 at 10) and (0.3, 0.9): 0.200 ± 0.141 and 0.700 ±
    # 0.283; a column per seed would give 0.300 ± 0.283 and 0.600 ± 0.424, and naive's one seed one column
    scores = {"grpo-s0": [.1, .5], "grpo-s1": [.3, .9], "pods-s1": [.2, .2], "pods-s0": [.4, .4],
              "naive-s0": [.4, .6]}
    monkeypatch.setattr(report, "robust_plan", lambda folder, step, budgets: (folder, budgets))
    monkeypatch.setattr(report, "robust_accuracy", lambda folder, budgets, device: scores[Path(folder).name])
    report.main(["runs", *runs, "--robust-budgets", "12", "10", "--out", str(tmp_path / "r")])
    comparison = tables(capsys.readouterr().out)[0]
    assert comparison["variant"][8:10] == ["sparse @ 12", "sparse @ 10"]
    assert comparison["grpo"][8:10] == ["0.200 ± 0.141", "0.700 ± 0.283"]
    assert comparison["pods"][8:10] == ["0.300 ± 0.141", "0.300 ± 0.141"]
    assert comparison["naive"][8:11] == ["0.400", "0.600", "25.0%"]


def test_dropped_tokens_and_peak_kv_count_every_logged_step(tmp_path):
    # Pins the columns that are not totals up to the last evaluation: a run killed after step 3 (its last
    # evaluation at 2) dropped 50 of step 3's 100 tokens at a peak KV of 10 %: dropped 50 / 300 = 16.7 %, peak KV
    # (1 + 1 + 0.1) / 3 = 70.0 %. Reading only the steps up to the evaluation gave 0.0 % and 100.0 %
    metrics = [line(s, 100, 0, 0, 100, 100, (1, 0, 0), [1.0]) for s in (1, 2)] + [line(3, 100, 50, 0, 10, 100,
                                                                                          (1, 0, 0), [1.0])]
    groups = {"v": [report.read_run(write_run(tmp_path / "v-s0", metrics, [(0, .5, .5), (2, .6, .6)]))]}
    assert report.comparison_rows(groups)[0][9:11] == ["70.0%", "16.7%"]


def test_a_tail_of_0_counts_in_its_bins_mean():
    # Pins tail_by_variant's `is not None`: a step whose 5th percentile of alpha is 0.0 (a bin where the sparse
    # sampler put its mass elsewhere) counts: (0.0 + 0.5) / 2 = 0.25; a truthiness test dropped it (0.5)
    metrics = [dict(bin_size=16, alpha_p05_by_bin=[0.0]), dict(bin_size=16, alpha_p05_by_bin=[0.5])]
    assert report.tail_by_variant({"v": [(metrics, None)]}) == {"v": {(0, 15): 0.25}}


def test_the_note_on_lost_metrics_counts_seeds_and_steps_apart(tmp_path):
    # Pins the note's two counts: seed 0 lost steps 2 and 3 (its eval.jsonl goes on to 4), seed 1 none: 1 of the
    # 2 seeds, 2 steps in all (one count printed for the other read "1 steps" or "2 of the 2 seeds")
    steps = lambda *ss: [line(s, 100, 0, 0, 1, 1, (1, 0, 0), [1.0]) for s in ss]
    groups = {"v": [report.read_run(write_run(tmp_path / f"v-s{i}", m, [(0, .5, .5), (4, .6, .6)]))
                    for i, m in enumerate((steps(1, 4), steps(1, 2, 3, 4)))]}
    notes = [l for l in report.report_text(groups).splitlines() if l.startswith("Note:")]
    assert notes == ["Note: 1 of the 2 seeds of v lack the metrics of 2 steps in all before their last evaluation, "
                     "so its vetoed, train time and time to the baseline's best count only the steps logged."]


def test_read_run_sorts_lines_written_out_of_step_order(tmp_path):
    # Pins read_run's sort: logs joined out of order (eval.jsonl 0, 3, 2; metrics 3, 1, 2) are read in step
    # order, so the 'after' columns read step 3's evaluation, not the last line's step 2
    metrics = [line(s, 100, 0, 0, 1, 1, (1, 0, 0), [1.0]) for s in (3, 1, 2)]
    folder = write_run(tmp_path / "r-s0", metrics, [(0, .5, .5), (3, .9, .9), (2, .6, .6)])
    metrics, evals = report.read_run(folder)
    assert [m["step"] for m in metrics] == [1, 2, 3] and [e["step"] for e in evals] == [0, 2, 3]


def test_the_plots_draw_the_mean_curves(tmp_path, monkeypatch):
    # Pins plot's curves, drawn into a stand-in for matplotlib: the reward's running mean (of 10) of the mean over
    # seeds (0.2, 0.3, 0.4 -> 0.2, 0.25, 0.3), the dense accuracy's mean over seeds at each evaluation, and the
    # tail at each bin's first position (0, 16), with Sparrow's threshold; each figure to PREFIX_<name>.png
    drawn = {}

    class Axes:
        def __init__(self):
            self.lines = []

        def plot(self, xs, ys, label, marker):
            self.lines.append((label, list(xs), [round(float(y), 6) for y in ys]))

        def axhline(self, y, **kwargs):
            self.lines.append(("threshold", y))

        def set(self, **kwargs):
            pass

        def legend(self):
            pass

    class Figure:
        def __init__(self, ax):
            self.ax = ax

        def tight_layout(self):
            pass

        def savefig(self, path, dpi):
            drawn[Path(path).name] = self.ax.lines

    class Plt:
        def subplots(self, figsize):
            ax = Axes()
            return Figure(ax), ax

        def close(self, fig):
            pass
    monkeypatch.setattr(report, "pyplot", lambda paths: Plt())
    seed = lambda rewards, tails: [line(s, 100, 0, 0, 1, 1, (1, 0, 0), t, reward=r)
                                   for s, r, t in zip((1, 2, 3), rewards, tails)]
    groups = {"v": [(seed((.1, .2, .3), ([.5, .9], [.7], [.6])), [dict(step=0, dense=.5, sparse=.1),
                                                                  dict(step=3, dense=.6, sparse=.1)]),
                    (seed((.3, .4, .5), ([.3], [.5], [.4])), [dict(step=0, dense=.3, sparse=.1),
                                                              dict(step=3, dense=.8, sparse=.1)])]}
    report.plot(groups, str(tmp_path / "p"))
    assert drawn == {"p_reward.png": [("v", [1, 2, 3], [0.2, 0.25, 0.3])],
                     "p_accuracy.png": [("v", [0, 3], [0.4, 0.7])],
                     "p_tail.png": [("v", [0, 16], [0.5, 0.9]), ("threshold", report.THRESHOLD)]}


def test_a_missing_results_runs_folder_says_how_it_is_made(tmp_path):
    # Pins read_run's hint: results/runs/<run> without its logs (reproduce.sh not run yet) says what makes them;
    # another folder gets no such hint
    hint = " \\(results/runs is made by `bash reproduce.sh`\\)"
    for folder, end in ((tmp_path / "results" / "runs" / "dense-s0", hint), (tmp_path / "mine" / "dense-s0", "")):
        folder.mkdir(parents=True)
        with pytest.raises(ValueError, match=f"dense-s0' is not a train.py run folder: it holds no metrics.jsonl"
                                             f"{end}$"):
            report.read_run(str(folder))


@pytest.fixture(scope="module")
def final_checkpoint(tmp_path_factory):
    """A tiny run's final checkpoint: SMALL's toy model after 60 warm-up steps, saved as train.py saves (step 1) with
    a DistillSparse adapter whose B is random (a trained adapter's answers differ from theta's), for a run of --seed 1
    (its held-out prompts are seed 1's); -> (its folder, its args)."""
    out = tmp_path_factory.mktemp("final")
    args = train.parse_args(SMALL + ["--warmup-steps", "60", "--out", str(out)])
    model, tokenizer = train.load_model(args, torch.device("cpu"))
    lora, generator = distill.LoRA(model, rank=4), torch.Generator().manual_seed(0)
    for B in lora.B.values():
        B.data.normal_(std=0.05, generator=generator)
    args.seed = 1
    models.save_checkpoint(out, 1, model, tokenizer, args, {}, adapter=lora)
    lora.remove()
    return out / "step-000001", args


def spied_evaluations(monkeypatch):
    """report.eval_rewards, spied on: -> [(the model's weights' dtype, autocast's dtype or None, an adapter passed
    or hooked on the model)] a call."""
    seen = []

    def spied(model, *args, **kwargs):
        seen.append((next(model.parameters()).dtype,
                     torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None,
                     len(args) > 5 or kwargs.get("lora") is not None or any(m._forward_hooks for m in model.modules())))
        return eval_rewards(model, *args, **kwargs)
    monkeypatch.setattr(report, "eval_rewards", spied)
    return seen


EXACT = lambda text, answer: float(text.strip() == answer)                       # sort's reward, by hand
CACHES = [SparseConfig("snapkv", 10, 2, 2, 2, page_size=4, dense_layers=1), SparseConfig("full")]   # SMALL's, by hand


def test_robust_accuracy_is_each_caches_greedy_accuracy_of_theta_alone_on_the_runs_held_out_prompts(
        final_checkpoint, monkeypatch):
    """Pins robust_accuracy against a greedy loop, one prompt at a time, through each cache built by hand: the
    checkpoint's fp32 model, theta alone (not the adapter saved beside it), on the 32 held-out sort prompts of the
    run's --seed 1 up to its --max-new-tokens, an exact answer's share, in the caches' order. Here SnapKV 10
    scores 0.375, full 0.469 (a cache swapped, or one for all, is caught); SnapKV 10 on seed 0's prompts 0.344,
    with the adapter 0."""
    ckpt, args = final_checkpoint
    args = argparse.Namespace(**dict(vars(args), max_new_tokens=8))     # the longest answer's 8 digits (at 7: 0.344, 0.406)
    seen = spied_evaluations(monkeypatch)
    got = report.robust_accuracy(ckpt, args, CACHES, torch.device("cpu"))
    model, tokenizer = models.load_pretrained(str(ckpt))
    held_out = held_out_examples("sort", 32, 1, 4, 8)

    def greedy_accuracy(sparse):
        right = 0
        for e in held_out:
            out = generate(model, [encode_prompt(tokenizer, e["prompt"])], sparse, 8, temperature=0,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            text = tokenizer.decode(out.tokens[0, :int(out.mask[0].sum())].tolist(), skip_special_tokens=True)
            right += text.strip() == e["answer"]
        return right / len(held_out)
    assert got == [greedy_accuracy(sparse) for sparse in CACHES] and got[0] != got[1], got
    assert seen == [(torch.float32, None, False)] * 2                   # fp32, no autocast, no adapter
    lora = distill.LoRA.from_file(model, ckpt / "adapter.safetensors")   # the adapter would have been seen
    assert accuracy(eval_rewards(model, tokenizer, held_out, EXACT, CACHES[0], 8, lora)) != got[0]


def test_robust_accuracy_of_a_bfloat16_run_is_its_fp32_weights_under_autocast(final_checkpoint, monkeypatch):
    # As train.py evaluates a --dtype bfloat16 run: fp32 weights, each evaluation under bf16 autocast, theta alone
    # (bf16 weights answer otherwise: README); against eval_rewards on the checkpoint's fp32 model under autocast
    ckpt, args = final_checkpoint
    args = argparse.Namespace(**dict(vars(args), dtype="bfloat16"))
    seen = spied_evaluations(monkeypatch)
    got = report.robust_accuracy(ckpt, args, CACHES, torch.device("cpu"))
    model, tokenizer = models.load_pretrained(str(ckpt))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = [accuracy(eval_rewards(model, tokenizer, held_out_examples("sort", 32, 1, 4, 8),
                                      EXACT, sparse, 10)) for sparse in CACHES]
    assert got == want and seen == [(torch.float32, torch.bfloat16, False)] * 2, (got, seen)
