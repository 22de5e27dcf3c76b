"""gpu_check.sh, the one device call of README "On one GPU". Run here at toy sizes (DEVICE=cpu): every stage's
command is one the current code accepts, each writes its file, a call returns what the device tool can carry, and
a stage that fails or runs out of time costs only itself. The GPU's own command lines (DEVICE=cuda) are recorded
by a stub interpreter and checked against each script's argument parser. The GPU tests' stage is stubbed (CI runs
tests/test_gpu.py itself): ~1 minute."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import bench
import bench_gpu
import bench_static
import cli
from kvcache import SparseConfig

SCRIPT = Path(__file__).resolve().parent.parent / "gpu_check.sh"
STAGES = ["test_gpu.txt", "bench_gpu.log", "train_gpu_fp32.txt", "train_gpu_bf16.txt", "step_times.txt"]


def run(tmp_path, *steps, broken="no such command", slow="no such command", device="cpu", **env):
    """gpu_check.sh STEPS, its output folder in tmp_path/out; -> (the process, that folder). A stub interpreter
    runs each command with this Python, but for `-m pytest` (it only says it ran), a command line holding `broken`
    (exit code 3 at once) and one holding `slow` (it sleeps). It records each command line in tmp_path/seen, its
    arguments separated by \x1f (one holds Python code, newlines and quotes in it), the lines by \x1e."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    stub, seen = tmp_path / "python", tmp_path / "seen"
    stub.write_text(f'#!/usr/bin/env bash\nprintf "%s\\x1f" "$@" >> {seen}; printf "\\x1e" >> {seen}\n'
                    f'case "$*" in *"{broken}"*) exit 3 ;; *"{slow}"*) exec sleep 60 ;; esac\n'
                    f'[ "$1 $2" = "-m pytest" ] && {{ echo "pytest $*"; exit 0; }}\n'
                    + ('exit 0\n' if device == "cuda" else f'exec {sys.executable} "$@"\n'))
    stub.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, DEVICE=device, PY=str(stub), OUT=str(out), OMP_NUM_THREADS="1", **env)
    return subprocess.run(["bash", str(SCRIPT), *steps], capture_output=True, text=True, env=env, timeout=300), out


@pytest.fixture(scope="module")
def call(tmp_path_factory):
    """The device call, `bash gpu_check.sh` with no step named: (process, its folder)."""
    return run(tmp_path_factory.mktemp("gpu_check"))


def stages(summary):
    """(name, what happened) of each stage in a summary file's text."""
    return [(line.split()[1].rstrip(":"), line.split(": ", 1)[1].split(" after")[0].split(",")[0])
            for line in summary.splitlines() if ": exit " in line or ": not run" in line]


def test_every_stage_runs_in_order_and_exits_0(call):
    done, out = call
    assert done.returncode == 0, done.stdout + done.stderr
    assert stages((out / "summary.txt").read_text()) == [(name, "exit 0") for name in STAGES]
    assert "GPU_TESTS_DEVICE=cpu" in (out / "summary.txt").read_text()
    assert "tests/test_gpu.py" in (out / "test_gpu.txt").read_text()


def test_the_call_returns_at_most_what_the_device_tool_carries(call):
    """The device tool brings back 8 files from a call: its stages' files, the bench's tables, the summary."""
    assert sorted(p.name for p in call[1].iterdir()) == sorted(STAGES + ["bench_gpu.md", "bench_gpu.json", "summary.txt"])


def test_each_stage_wrote_what_it_measures_and_the_digest_shows_it(call):
    done, out = call
    for precision in ("fp32", "bf16"):   # the toy run's summary table, as the README quotes it
        text = (out / f"train_gpu_{precision}.txt").read_text()
        assert "| before RL |" in text and "| after RL  |" in text and "wall time:" in text
    steps = (out / "step_times.txt").read_text()
    for policy in ("full", "streaming", "snapkv", "rkv", "h2o"):
        assert f"{policy:>10}: mean step" in steps
    record = json.loads((out / "bench_gpu.json").read_text())
    assert record["targets"] and "### Targets" in (out / "bench_gpu.md").read_text()
    # the digest, last on the screen, which is what the device tool's reply shows
    shown = done.stdout.split("\n== ")[1:]
    assert [part.split("\n")[0] for part in shown] == ["test_gpu.txt", "train_gpu_bf16.txt", "train_gpu_fp32.txt",
                                                        "step_times.txt", "bench_gpu.md"]
    assert shown[0].split("\n")[1].startswith("pytest ")       # no summary line: the stage's last lines
    assert "| after RL  |" in shown[1] and "h2o: mean step" in shown[3]
    assert shown[4].startswith("bench_gpu.md\nrows skipped past the deadline: 0, rows failed: 0\n### Targets")


def test_the_bench_is_told_to_begin_no_row_in_the_last_80_s_of_its_limit(tmp_path):
    done, out = run(tmp_path, "bench", CALL="200")   # left: 200 - 20 s (and the versions' read): under 380
    line = next(l for l in (out / "summary.txt").read_text().splitlines() if "bench_gpu.log: " in l and "bench.py" in l)
    limit = int(re.search(r"exit 0 after \d+ s \(limit (\d+) s\)", (out / "summary.txt").read_text()).group(1))
    assert 170 <= limit <= 180 and re.search(f"--deadline ({limit - 80}|{limit - 79}) ", line)   # $SECONDS may tick


def test_a_failing_stage_costs_only_itself_and_the_call_says_which(tmp_path):
    done, out = run(tmp_path, "tests", "train", "steps", broken="train.py")   # in the order given
    assert done.returncode == 1 and "failed: train_gpu_fp32.txt train_gpu_bf16.txt" in done.stderr
    assert [what for _, what in stages((out / "summary.txt").read_text())] == [
        "exit 0", "exit 3", "exit 3", "exit 0"]
    assert "full: mean step" in (out / "step_times.txt").read_text()     # the stages after them ran


def test_a_stage_past_the_calls_time_is_stopped_and_the_rest_not_begun(tmp_path):
    # CALL=40: the first stage may take what is left of 40 - 20 s once the versions are read (Python imports
    # torch: a few seconds); it sleeps, gets SIGINT at its limit, and leaves less than 10 s to the others
    done, out = run(tmp_path, slow="pytest", CALL="40")
    text = (out / "summary.txt").read_text()
    assert stages(text) == [("test_gpu.txt", "exit 124")] + [(name, "not run") for name in STAGES[1:]]
    assert done.returncode == 1 and "failed: " + " ".join(STAGES) in done.stderr
    took, limit = map(int, re.search(r"exit 124 after (\d+) s \(limit (\d+) s\)", text).groups())
    assert 10 <= limit <= 20 and limit <= took <= limit + 1


def test_the_gpu_commands_are_what_each_script_accepts(tmp_path, monkeypatch):
    # DEVICE=cuda through a stub that only records: each command line, parsed by the parser of the script it calls
    done, _ = run(tmp_path, device="cuda")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [call.split("\x1f")[:-1] for call in (tmp_path / "seen").read_text().split("\x1e")[:-1]]
    scripts = [next((a for a in line if a.endswith((".py", "pytest"))), line[0]) for line in lines]
    assert scripts == ["-c", "-c", "pytest", "bench.py", "train.py", "train.py", "bench_static.py"]
    assert lines[0] == ["-c", "import xdist"] and lines[2][:4] == ["-m", "pytest", "-n", "4"]   # the stub has it
    lines = lines[1:]

    class Parsed(Exception):
        pass

    def parsed(*args):
        raise Parsed
    assert lines[1][-1] == "tests/test_gpu.py"
    monkeypatch.setattr(bench_gpu, "main", parsed)
    with pytest.raises(Parsed):
        bench.main(lines[2][1:])
    assert "--quick" not in lines[2] and lines[2][lines[2].index("--deadline") + 1] == "300"   # its limit 380 - 80
    for line in lines[3:5]:                                    # the quick start's run, on CUDA, fp32 then bf16
        args = cli.parse_args(line[1:])
        assert (args.device, args.steps, args.warmup_steps, args.policy) == ("cuda", 200, 100, "snapkv")
    assert cli.parse_args(lines[4][1:]).dtype == "bfloat16"
    monkeypatch.setattr(bench_static, "pick_device", parsed)    # its main parses, then asks for the device
    with pytest.raises(Parsed):
        bench_static.main(lines[5][1:])
    args = dict(zip(lines[5][1::2], lines[5][2::2]))
    assert args["--shape"] == "qwen3-1.7b" and "--step-times" in lines[5]
    for policy in ["full", "streaming", "snapkv", "rkv", "h2o"]:   # what bench_static.main checks after the device
        SparseConfig(policy, budget=int(args["--budget"]), interval=int(args["--interval"]))


def test_an_unknown_step_is_refused_before_anything_runs(tmp_path):
    done, out = run(tmp_path, "tests", "bnech")
    assert done.returncode == 2 and "unknown step 'bnech': tests, train, bench or steps" in done.stderr
    assert not out.exists()


@pytest.mark.parametrize("env, message", [
    (dict(device="cuda:0"), "DEVICE='cuda:0': cuda (the default) or cpu"),          # was: the CPU's toy sizes, on a GPU
    (dict(CALL="480s"), "CALL='480s': the call's seconds, a whole number"),          # was: nothing run, and exit 0
])
def test_a_device_or_call_the_script_cannot_use_is_refused_before_anything_runs(tmp_path, env, message):
    done, out = run(tmp_path, "tests", **env)
    assert done.returncode == 2 and message in done.stderr and not out.exists()


def test_a_stage_at_its_limit_gets_sigint_so_the_bench_can_write_its_json(tmp_path):
    # Pins stage's signal: at its limit a command gets SIGINT (KeyboardInterrupt: bench_gpu.main then writes its
    # targets and JSON, tests/test_bench_gpu.py), not timeout's default SIGTERM, which kills Python silently.
    # The script's own stage function, taken from its text, runs a 1 s-limited Python that says what it got
    probe = "import time\ntry:\n    time.sleep(30)\nexcept KeyboardInterrupt:\n    print('KeyboardInterrupt')\n"
    script = (f'OUT={tmp_path}; SUMMARY={tmp_path}/summary.txt; CALL=100; FAILED=()\n'
              f'eval "$(sed -n "/^stage() {{/,/^}}/p" {SCRIPT})"\n'
              f'stage probe.txt 1 {sys.executable} -c "$PROBE"\n')
    subprocess.run(["bash", "-c", script], env=dict(os.environ, PROBE=probe), timeout=30, check=True)
    assert (tmp_path / "probe.txt").read_text() == "KeyboardInterrupt\n"
    assert re.search(r"probe.txt: exit 124 after \d+ s \(limit 1 s\)", (tmp_path / "summary.txt").read_text())
