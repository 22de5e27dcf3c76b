"""lab.py on a temporary git copy of the repository, never on the real files: start then reset gives the
same bytes, the stub keeps the signature, the docstring and the argument checks, and after `start` the
exercise's own test command fails."""
import ast
import code
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import lab
from lab import EXERCISES, LabError, find_function, head_statements

GIT = ["git", "-c", "user.name=lab", "-c", "user.email=lab@example.com"]


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """A committed copy of the repository's files (tracked, and untracked ones git does not ignore)."""
    root = tmp_path_factory.mktemp("repo")
    listed = subprocess.run(["git", "-C", str(lab.ROOT), "ls-files", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, text=True, check=True).stdout.split()
    for name in listed:
        if (lab.ROOT / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(lab.ROOT / name, root / name)
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "copy"]):
        subprocess.run(GIT + command, cwd=root, check=True)
    return root


def correction_alone(tmp_path):
    """(a committed repository holding correction.py alone, its text): for the tests that write into it."""
    root = tmp_path / "r"
    root.mkdir()
    original = (lab.ROOT / "correction.py").read_text()
    (root / "correction.py").write_text(original)
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "copy"]):
        subprocess.run(GIT + command, cwd=root, check=True)
    return root, original


def load(path, name):
    """Import one file of the copy as a fresh module (correction.py imports only torch)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_start_then_reset_gives_the_same_bytes(repo):
    files = {ex.file: (repo / ex.file).read_bytes() for ex in EXERCISES.values()}
    for n, ex in EXERCISES.items():
        lab.start(n, repo)
        assert (repo / ex.file).read_bytes() != files[ex.file]
        assert "already started" in lab.start(n, repo)            # a second start changes nothing
    for n in EXERCISES:                                             # all five stubs at once, then all reset
        lab.reset(n, repo)
    assert {name: (repo / name).read_bytes() for name in files} == files
    # the stubs committed (as a student might): reset still finds the original in the history
    lab.start(4, repo)
    subprocess.run(GIT + ["commit", "-q", "-am", "stub"], cwd=repo, check=True)
    lab.reset(4, repo)
    assert (repo / "schedule.py").read_bytes() == files["schedule.py"]
    subprocess.run(GIT + ["commit", "-q", "-am", "reset"], cwd=repo, check=True)


@pytest.mark.parametrize("n", EXERCISES)
def test_the_stub_keeps_signature_docstring_and_checks(repo, n):
    ex = EXERCISES[n]
    original = find_function((repo / ex.file).read_text(), ex.function)
    lab.start(n, repo)
    try:
        stub = find_function((repo / ex.file).read_text(), ex.function)
    finally:
        lab.reset(n, repo)
    assert ast.dump(stub.args) == ast.dump(original.args)
    assert ast.get_docstring(stub) == ast.get_docstring(original)
    kept = head_statements(original)
    assert [ast.dump(s) for s in stub.body[:-1]] == [ast.dump(s) for s in original.body[:kept]]
    assert len(stub.body) == kept + 1 and f"exercise {n}:" in ast.unparse(stub.body[-1])
    # exactly the ValueError checks at the top (the docstring counts 1): none in snapkv
    assert kept - 1 == {1: 3, 2: 4, 3: 0, 4: 1, 5: 4}[n]   # 4: check_bins; 5: check_groups, n = group_size, two ifs


def test_the_stubs_still_check_their_arguments(repo):
    for n in (1, 2, 5):
        lab.start(n, repo)
    try:
        stubbed = load(repo / "correction.py", "stubbed_correction")
    finally:
        for n in (1, 2, 5):
            lab.reset(n, repo)
    z = torch.zeros(2, 3)
    for call, message in [(lambda: stubbed.importance_weights(z, z, cap=0.0), "cap must be > 0"),
                          (lambda: stubbed.rejection_mask(z, z, veto=-1.0), "veto must be >= 0"),
                          (lambda: stubbed.downsample(torch.zeros(8), 4, 5), "m must be an integer")]:
        with pytest.raises(ValueError, match=message):
            call()
    for call, n in [(lambda: stubbed.importance_weights(z, z), 1), (lambda: stubbed.rejection_mask(z, z), 2),
                    (lambda: stubbed.downsample(torch.zeros(8), 4, 2), 5)]:
        with pytest.raises(NotImplementedError, match=f"exercise {n}: write the body of"):
            call()


# One interpreter for the five runs (torch and transformers are imported once): each exercise is started,
# its command's pytest arguments run in-process on fresh imports of the copy's modules, then reset.
RUN_EACH_STARTED = """
import json, sys
from pathlib import Path
import pytest
import lab
root = Path.cwd()
local = {p.stem for p in root.glob("*.py")} | {p.stem for p in root.glob("tests/*.py")}
codes = {}
for n in lab.EXERCISES:
    lab.start(n, root)
    for name in [m for m in sys.modules if m.split(".")[0] in local - {"lab"}]:
        del sys.modules[name]
    try:
        codes[n] = int(pytest.main([*lab.test_command(n)[3:], "-x", "-q", "-p", "no:cacheprovider"]))
    finally:
        lab.reset(n, root)
print("exit codes:", json.dumps(codes))
"""


def test_after_start_each_exercise_command_fails(repo):
    run = subprocess.run([sys.executable, "-c", RUN_EACH_STARTED], cwd=repo, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert 'exit codes: {"1": 1, "2": 1, "3": 1, "4": 1, "5": 1}' in run.stdout, run.stdout[-3000:]   # 1: tests failed
    for n in EXERCISES:
        assert f"NotImplementedError: exercise {n}: write the body of" in run.stdout
    assert lab.test_command(3) == ["python", "-m", "pytest", "tests/test_kvcache.py", "tests/test_policies.py"]


def test_bad_exercise_numbers_and_edited_functions_are_clear_errors(repo, capsys, monkeypatch):
    start, reset = lab.start, lab.reset
    for action in ("start", "reset"):   # main works on this clone: a refused call may check n, never edit a file
        monkeypatch.setattr(lab, action, lambda n, action=action: lab.exercise(n) and pytest.fail(f"{action} ran"))
    for bad in ("0", "6", "x", ""):
        with pytest.raises(LabError, match="choose one of 1, 2, 3, 4, 5"):
            lab.exercise(bad)
    assert lab.main(["start", "7"]) == 2 and "no exercise '7'" in capsys.readouterr().err
    assert lab.main(["reset"]) == 2 and "needs an exercise number" in capsys.readouterr().err
    assert lab.main(["start", "1", "2"]) == 2 and "takes one exercise at a time, got 1 and 2" in capsys.readouterr().err
    # `test 1 2` handed "2" to pytest, which said only "file or directory not found: 2"
    monkeypatch.setattr(lab, "test", lambda *args: pytest.fail("test ran"))
    assert lab.main(["test", "1", "2"]) == 2 and "takes one exercise at a time, got 1 and 2" in capsys.readouterr().err
    assert lab.main(["list", "3"]) == 2 and "lab.py list` takes no exercise number, got 3" in capsys.readouterr().err
    with pytest.raises(SystemExit):                                  # no action: say which there are
        lab.main([])
    assert capsys.readouterr().err.endswith("error: give an action: list, start N, test N or reset N\n")
    path = repo / "correction.py"
    before = path.read_text()
    path.write_text(before.replace("    return w\n", "    return w * 1\n", 1))   # a student's own version
    try:
        with pytest.raises(LabError, match="differs from the committed one"):
            start(1, repo)
    finally:
        reset(1, repo)
    assert path.read_text() == before


def test_starting_beside_a_stub_that_shares_its_tests_says_so(repo):
    # exercises 1, 2 and 5 are all pinned by tests/test_correction.py: a second stub's failures would show in the first's
    try:
        assert "Note" not in lab.start(1, repo)
        assert lab.start(2, repo).endswith("Note: exercise 1 (importance_weights) is a stub and shares its tests, "
                                           "whose failures will show too: finish or reset first (LAB.md)")
        assert "Note" not in lab.start(4, repo)                     # schedule.py's tests are its own
        assert "Note: exercise 1 (importance_weights) and exercise 2 (rejection_mask) are stubs and share their " \
               "tests" in lab.start(5, repo)
    finally:
        for n in (1, 2, 4, 5):
            lab.reset(n, repo)


def test_a_file_that_does_not_parse_is_named_with_its_line(repo):
    # a student mid-edit: start, reset and list say which file and line, and how to take the file back
    path = repo / "schedule.py"
    before = path.read_text()
    path.write_text(before.replace("def tail_by_bin(", "def tail_by_bin((", 1))
    line = before[: before.index("def tail_by_bin(")].count("\n") + 1
    try:
        for call in (lambda: lab.start(4, repo), lambda: lab.reset(4, repo), lambda: lab.listing(repo)):
            with pytest.raises(LabError, match=f"schedule.py does not parse \\(line {line}: .*git checkout -- schedule.py"):
                call()
    finally:
        path.write_text(before)


def test_a_file_whose_function_is_gone_is_named_with_the_way_back(repo):
    # a student who renamed the function: was "no function tail_by_bin at the top level of the file", no file named
    path = repo / "schedule.py"
    before = path.read_text()
    path.write_text(before.replace("def tail_by_bin(", "def tail_by_bins(", 1))
    try:
        for call in (lambda: lab.start(4, repo), lambda: lab.reset(4, repo), lambda: lab.listing(repo)):
            with pytest.raises(LabError, match="^schedule.py holds no top-level function tail_by_bin: put it "
                                               "back, or take the whole file back from git with `git checkout --"):
                call()
    finally:
        path.write_text(before)


SYNTHETIC = '''import functools


@functools.lru_cache
@functools.wraps(print)
def checked(x, n):
    """Doc."""
    check_x(x)
    k = n
    if k < 0:
        raise ValueError("n")
    if x is None:
        raise TypeError("x")
    return x


def with_else(x):
    """Doc."""
    if x < 0:
        raise ValueError("x")
    else:
        x = 1
    return x


def two_statements(x):
    """Doc."""
    if x < 0:
        raise ValueError("x")
        print("after")
    return x


def computed_alias(n):
    """Doc."""
    check_n(n)
    m = n + 1
    if m < 0:
        raise ValueError("m")
    return m


def raises_then_more(x):
    """Doc."""
    raise NotImplementedError("todo")
    return x


class Holder:
    def method(self):
        return 1
'''


def test_what_counts_as_an_argument_check_on_hand_written_functions():
    # Pins is_check / head_statements / is_stub / function_lines / find_function on functions written for it:
    # checked keeps its docstring, check_x(x), the alias k = n and the ValueError if (4), not the TypeError if;
    # an if with an else, or with a second statement, is no check (1: the docstring only); a computed
    # assignment (m = n + 1) ends the head (2); a NotImplementedError followed by more code is no stub; the
    # function's lines start at its first decorator (line 4, 0-based 3); a method is not a top-level function
    kept = {name: head_statements(find_function(SYNTHETIC, name))
            for name in ("checked", "with_else", "two_statements", "computed_alias")}
    assert kept == {"checked": 4, "with_else": 1, "two_statements": 1, "computed_alias": 2}
    assert not lab.is_stub(find_function(SYNTHETIC, "raises_then_more"))
    assert lab.function_lines(SYNTHETIC, "checked") == (3, 14)                # lines 4-14, 1-based
    with pytest.raises(LabError, match="no function method at the top level"):
        find_function(SYNTHETIC, "method")


def test_reset_takes_the_newest_unstubbed_version_of_the_function(tmp_path):
    # Pins original_function's history order: schedule.py committed, then tail_by_bin edited and committed, then
    # the stub committed (as a student might): reset must bring back the edited version, not the first commit's
    root = tmp_path / "r"
    root.mkdir()
    first = (lab.ROOT / "schedule.py").read_text()
    newer = first.replace("def tail_by_bin(", "def tail_by_bin(  # newer\n        ", 1)
    assert newer != first
    for text, message in ((first, "first"), (newer, "newer")):
        (root / "schedule.py").write_text(text)
        for command in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", message]):
            subprocess.run(GIT + command, cwd=root, check=True)
    lab.start(4, root)
    subprocess.run(GIT + ["commit", "-q", "-am", "stub"], cwd=root, check=True)
    lab.reset(4, root)
    assert (root / "schedule.py").read_text() == newer


def test_the_lab_works_in_a_subfolder_of_a_repository(tmp_path):
    # the project as a folder of a course's repository: `git show <commit>:correction.py` named a path from the
    # repository's root ("fatal: path 'sub/correction.py' exists, but not 'correction.py'"), so start and reset failed
    root = tmp_path / "course" / "sub"
    root.mkdir(parents=True)
    original = (lab.ROOT / "correction.py").read_text()
    (root / "correction.py").write_text(original)
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "course"]):
        subprocess.run(GIT + command, cwd=tmp_path / "course", check=True)
    lab.start(1, root)
    assert lab.is_stub(find_function((root / "correction.py").read_text(), "importance_weights"))
    lab.reset(1, root)
    assert (root / "correction.py").read_text() == original


def test_lab_test_runs_its_files_single_threaded_with_the_extra_arguments(monkeypatch, capsys):
    # Pins lab.test's subprocess: this interpreter, -m pytest, the exercise's files, then the extra arguments,
    # with OMP_NUM_THREADS=1 (the experiments' thread count), from the repository root; its exit status returned
    calls = []
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    monkeypatch.setattr(lab.subprocess, "run", lambda command, cwd, env: calls.append((command, cwd, env)) or
                        type("Done", (), dict(returncode=3))())
    assert lab.main(["test", "3", "-k", "snapkv"]) == 3
    (command, cwd, env), = calls
    assert command == [sys.executable, "-m", "pytest", "tests/test_kvcache.py", "tests/test_policies.py", "-k", "snapkv"]
    assert cwd == lab.ROOT and env["OMP_NUM_THREADS"] == "1"
    assert capsys.readouterr().out == "OMP_NUM_THREADS=1 python -m pytest tests/test_kvcache.py tests/test_policies.py -k snapkv\n"


def test_list_says_which_exercises_are_started(repo):
    # Pins listing's state column on the copy: exercise 4 started, the others written
    lab.start(4, repo)
    try:
        states = [row.rsplit("|", 2)[1].strip() for row in lab.listing(repo).splitlines()[2:]]
    finally:
        lab.reset(4, repo)
    assert states == ["written", "written", "written", "started (stub)", "written"]


def test_reset_keeps_the_students_own_version_before_putting_the_original_back(tmp_path):
    # reset overwrote a written (uncommitted) body with the original, and the student's work was gone
    root, original = correction_alone(tmp_path)
    lab.start(2, root)
    stub = (root / "correction.py").read_text()
    written = stub.replace('    raise NotImplementedError("exercise 2', '    return "mine"  # my work\n'
                           '    raise NotImplementedError("exercise 2', 1)
    mine = "".join(written.splitlines(keepends=True)[slice(*lab.function_lines(written, "rejection_mask"))])
    for copy in ("attempt-2.py", "attempt-2-2.py"):                   # a second attempt does not overwrite the first
        (root / "correction.py").write_text(written)
        assert lab.reset(2, root) == ("exercise 2 reset: correction.py:rejection_mask is the committed function "
                                      f"again; your version is kept in lab/{copy}")
        assert (root / "correction.py").read_text() == original and (root / "lab" / copy).read_text() == mine
    (root / "correction.py").write_text(stub)                          # a stub is no attempt: nothing kept
    assert lab.reset(2, root) == "exercise 2 reset: correction.py:rejection_mask is the committed function again"
    assert sorted(p.name for p in (root / "lab").iterdir()) == ["attempt-2-2.py", "attempt-2.py"]


def test_each_python_snippet_of_lab_md_pastes_into_the_python_prompt():
    # the plain interactive interpreter (Python <= 3.12's) needs a blank line after an indented block: 4a's trace,
    # pasted as LAB.md says ("in `python`"), was a SyntaxError at `schedule.measure = traced`, and the calibration
    # then ran untraced. Compiled line by line as that prompt reads them (code.InteractiveConsole), never run.
    snippets = re.findall(r"```python\n(.*?)```", (lab.ROOT / "LAB.md").read_text(), re.S)
    assert len(snippets) == 2                                          # the plot (exercise 4) and 4a's trace
    for snippet in snippets:
        console, errors = code.InteractiveConsole(), []
        console.runcode = lambda compiled: None
        console.showsyntaxerror = lambda *args, **kwargs: errors.append(sys.exc_info()[1])
        for line in snippet.splitlines():
            console.push(line)
        assert not console.push("") and errors == [], (errors, snippet[:60])


def test_a_kill_while_start_writes_leaves_the_file_whole(tmp_path, monkeypatch):
    # start wrote the stub over the exercise's file in place (reset went through a temporary file and a rename): a
    # kill halfway through the write left correction.py cut in two, so that no exercise's tests even imported it
    root, original = correction_alone(tmp_path)
    write_text = lab.Path.write_text

    def killed(path, text):                                            # half the text reaches the disk, then the kill
        write_text(path, text[: len(text) // 2])
        raise KeyboardInterrupt

    monkeypatch.setattr(lab.Path, "write_text", killed)
    for call in (lambda: lab.start(1, root), lambda: lab.reset(1, root)):
        with pytest.raises(KeyboardInterrupt):
            call()
        assert (root / "correction.py").read_text() == original


def test_starting_beside_the_snapkv_stub_says_so(repo):
    # test_correction.py and test_schedule.py sample through SnapKV: with exercise 3 a stub, `lab.py test 4` showed
    # 5 failures and `lab.py test 1` one, each a NotImplementedError of exercise 3, and start said nothing of it
    try:
        assert "Note" not in lab.start(3, repo)
        for n in (1, 4):
            assert lab.start(n, repo).endswith("Note: exercise 3 (snapkv) is a stub and shares its tests, whose "
                                               "failures will show too: finish or reset first (LAB.md)")
            lab.reset(n, repo)
    finally:
        for n in (1, 3, 4):
            lab.reset(n, repo)


def test_the_python_snippet_that_computes_runs_single_threaded():
    # LAB.md's numbers are one thread's (the set-up says so), but 4a's trace ran the calibration "in `python`", on
    # torch's default thread count: on our 2-core EPYC it printed bin 32-47's tail 0.8072, one thread prints 0.8071
    text = (lab.ROOT / "LAB.md").read_text()
    for match in re.finditer(r"```python\n(.*?)```", text, re.S):
        before = text[: match.start()].rsplit("\n\n", 2)[-2]            # the paragraph that introduces it
        if "main(" in match.group(1):                                  # runs a command's computation
            assert "OMP_NUM_THREADS=1 python" in before, before


MORE_SYNTHETIC = '''def undocumented(x):
    y = x + 1
    return y


def not_checks(x):
    """Doc."""
    checkpoint(x)
    print(x)
    if x < 0:
        raise ValueError
    return x


def other_raise(x):
    """Doc."""
    raise RuntimeError("todo")
'''


def test_what_is_no_check_and_no_stub_on_hand_written_functions():
    # Pins the edges the first synthetic functions leave open: without a docstring nothing is kept for it (0, not
    # 1); a call to a helper whose name only starts with "check" (checkpoint), any other call (print) and a bare
    # `raise ValueError` (no call: no message) are no checks, and reading the last must not fail; a body that raises
    # anything but NotImplementedError is no stub (mutants: kept = 1 always, startswith("check"), any call a
    # check, the Call test dropped, any raise a stub)
    assert head_statements(find_function(MORE_SYNTHETIC, "undocumented")) == 0
    assert head_statements(find_function(MORE_SYNTHETIC, "not_checks")) == 1
    assert not lab.is_check(find_function(MORE_SYNTHETIC, "not_checks").body[3])
    assert not lab.is_stub(find_function(MORE_SYNTHETIC, "other_raise"))


def test_an_exercise_number_may_come_with_spaces_and_as_a_string():
    # Pins exercise's str(n).strip(): " 3 " (a pasted argument) and "3" are exercise 3, as 3 is (mutant: no strip)
    assert lab.exercise(" 3 ") == lab.exercise("3") == lab.exercise(3) == EXERCISES[3]


def test_a_string_exercise_number_is_not_its_own_neighbour(repo):
    # main passes n as the command line's string: start's note must still leave the exercise itself out (mutant:
    # k != n, "2" != 2, so exercise 2 named itself as a stub sharing its own tests)
    try:
        assert "Note" not in lab.start("2", repo)
    finally:
        lab.reset(2, repo)


def test_main_runs_the_action_it_is_given_and_prints_its_report(monkeypatch, capsys):
    # Pins main's dispatch: start N to start, reset N to reset, with n as given; each report printed, exit 0; list
    # prints the listing, exit 0 (mutants: start and reset swapped, the report not printed, list's exit 1)
    monkeypatch.setattr(lab, "start", lambda n: f"started {n}")
    monkeypatch.setattr(lab, "reset", lambda n: f"reset {n}")
    monkeypatch.setattr(lab, "listing", lambda: "the table")
    for argv, printed in ((["start", "4"], "started 4\n"), (["reset", "2"], "reset 2\n"), (["list"], "the table\n")):
        assert lab.main(argv) == 0 and capsys.readouterr().out == printed


def test_list_rows_name_the_module_function_sections_and_command(repo):
    # Pins listing's rows, written out by hand from EXERCISES: the module without .py, the docs sections, the lab
    # command and the pytest command it runs (mutants: the .py kept, tests for sections, the command dropped)
    rows = lab.listing(repo).splitlines()
    assert rows[:2] == ["| N | function | docs/method.md | test command | state |", "|---|---|---|---|---|"]
    assert rows[4] == ("| 3 | `policies.snapkv` | section 2 | `python lab.py test 3` = `python -m pytest "
                       "tests/test_kvcache.py tests/test_policies.py` | written |")
    assert len(rows) == 7


def test_reset_skips_a_commit_in_which_the_file_does_not_parse(tmp_path):
    # Pins original_function's `except SyntaxError`: a student who committed correction.py mid-edit (it does not
    # parse), then started over: the history's newest commit cannot be read, and reset takes the one before
    root, original = correction_alone(tmp_path)
    (root / "correction.py").write_text(original.replace("def importance_weights(", "def importance_weights((", 1))
    subprocess.run(GIT + ["commit", "-q", "-am", "mid-edit"], cwd=root, check=True)
    (root / "correction.py").write_text(original.replace("    return w\n", "    return w * 1\n", 1))
    assert lab.reset(1, root).startswith("exercise 1 reset")
    assert (root / "correction.py").read_text() == original
