"""gpu_check.sh, the two device calls of README "On one GPU", run here at toy sizes (DEVICE=cpu): every stage's
command is one the current code accepts, each writes its file, and a call returns what the device tool can carry.
The GPU tests' stage is stubbed (CI runs tests/test_gpu.py itself), so this takes ~30 s, not ~90."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "gpu_check.sh"
CHECK = ["test_gpu.txt", "train_gpu_fp32.txt", "train_gpu_bf16.txt", "bench_quick.txt", "step_times.txt"]


def run(tmp_path, *steps, broken="no such command"):
    """gpu_check.sh STEPS on the CPU, its output folder in tmp_path/out; -> (the process, that folder).
    A command line holding `broken` fails at once with exit code 3."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    stub = tmp_path / "python"   # the interpreter the script calls, but for `-m pytest`, which only says it ran
    stub.write_text(f'#!/usr/bin/env bash\n[ "$1 $2" = "-m pytest" ] && {{ echo "pytest $*"; exit 0; }}\n'
                    f'case "$*" in *"{broken}"*) exit 3 ;; esac\nexec {sys.executable} "$@"\n')
    stub.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, DEVICE="cpu", PY=str(stub), OUT=str(out), OMP_NUM_THREADS="1")
    return subprocess.run(["bash", str(SCRIPT), *steps], capture_output=True, text=True, env=env, timeout=300), out


@pytest.fixture(scope="module")
def calls(tmp_path_factory):
    """The two device calls, each into a folder of its own as the device tool gives: {step: (process, folder)}."""
    tmp = tmp_path_factory.mktemp("gpu_check")
    return {step: run(tmp / step, step) for step in ("check", "bench")}


def test_every_stage_of_both_calls_runs_and_exits_0(calls):
    for step, stages in (("check", CHECK), ("bench", ["bench_gpu.log"])):
        done, out = calls[step]
        assert done.returncode == 0, done.stdout + done.stderr
        summary = (out / "summary.txt").read_text()
        assert [line.split()[1].rstrip(":") for line in summary.splitlines() if " exit " in line] == stages
        assert summary.count("exit 0 after") == len(stages), summary
    assert "GPU_TESTS_DEVICE=cpu" in (calls["check"][1] / "summary.txt").read_text()
    assert "tests/test_gpu.py" in (calls["check"][1] / "test_gpu.txt").read_text()


def test_a_call_returns_at_most_what_the_device_tool_carries(calls):
    """The device tool brings back 8 files from a call: each leaves its stages' files and summary.txt, 6 at most."""
    for step, files in (("check", CHECK), ("bench", ["bench_gpu.log", "bench_gpu.md", "bench_gpu.json"])):
        assert sorted(p.name for p in calls[step][1].iterdir()) == sorted(files + ["summary.txt"])


def test_each_stage_wrote_what_it_measures(calls):
    check, bench = calls["check"][1], calls["bench"][1]
    for precision in ("fp32", "bf16"):   # the toy run's summary table, as the README quotes it
        text = (check / f"train_gpu_{precision}.txt").read_text()
        assert "| before RL |" in text and "| after RL  |" in text and "wall time:" in text
    steps = (check / "step_times.txt").read_text()
    for policy in ("full", "streaming", "snapkv", "rkv", "h2o"):
        assert f"{policy:>10}: mean step" in steps
    record = json.loads((bench / "bench_gpu.json").read_text())
    assert record["targets"] and "### Targets" in (bench / "bench_gpu.md").read_text()
    # the digest, last on the screen, which is what the device tool's reply shows
    shown = calls["check"][0].stdout.split("\n== ")[1:]
    assert [part.split("\n")[0] for part in shown] == ["test_gpu.txt", "train_gpu_bf16.txt", "train_gpu_fp32.txt",
                                                        "step_times.txt"]
    assert "| after RL  |" in shown[1] and "h2o: mean step" in shown[3]
    assert calls["bench"][0].stdout.split("\n== ")[1].startswith("bench_gpu.md\n### Targets")


def test_an_unknown_step_is_refused_before_anything_runs(tmp_path):
    done, out = run(tmp_path, "check", "bnech")
    assert done.returncode == 2 and "unknown step 'bnech': check or bench" in done.stderr
    assert not (out / "summary.txt").exists()


def test_a_failing_stage_costs_only_itself_and_the_call_says_which(tmp_path):
    done, out = run(tmp_path, "check", broken="train.py")
    assert done.returncode == 1 and "failed: train_gpu_fp32.txt train_gpu_bf16.txt" in done.stderr
    summary = (out / "summary.txt").read_text()
    assert summary.count("exit 3 after") == 2 and summary.count("exit 0 after") == 3
    assert "full: mean step" in (out / "step_times.txt").read_text()     # the stages after them ran
