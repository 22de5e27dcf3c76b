"""The lab's helper (LAB.md): start an exercise without seeing its answer, test it, put the answer back.

    python lab.py list        the five exercises: function, file, docs section, test command, state
    python lab.py start N     exercise N's body becomes a stub: the signature, the docstring and the
                              argument checks at the top of the body stay, then NotImplementedError
    python lab.py test N      run every test that pins exercise N (extra arguments go to pytest)
    python lab.py reset N     put the original function back, taken from git and never printed

Functions are found with `ast`, never by matching code text, and only the exercise's function is
rewritten: the rest of its file is left as it is. `reset` takes the function from the newest commit
of its file in which it is not a stub, so it also works after a student committed the stub.
"""
import argparse
import ast
import os
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

ROOT = Path(__file__).resolve().parent

# sections: of docs/method.md; also: other test files that call the function (its stub turns some of them red)
Exercise = namedtuple("Exercise", "file function sections tests also", defaults=[()])
EXERCISES = {
    1: Exercise("correction.py", "importance_weights", "sections 1 and 5", ["tests/test_correction.py"]),
    2: Exercise("correction.py", "rejection_mask", "section 5", ["tests/test_correction.py"]),
    3: Exercise("policies.py", "snapkv", "section 2", ["tests/test_kvcache.py", "tests/test_policies.py"],
                ["tests/test_correction.py", "tests/test_schedule.py"]),   # they sample through SnapKV
    4: Exercise("schedule.py", "tail_by_bin", "sections 4 and 6", ["tests/test_schedule.py"]),
    5: Exercise("correction.py", "downsample", "section 7", ["tests/test_correction.py"]),
}


class LabError(Exception):
    """A mistake in how lab.py was called, said in one line."""


def exercise(n):
    """EXERCISES[n] for n given as an int or a string, or a LabError naming the valid numbers."""
    if str(n).strip() not in {str(k) for k in EXERCISES}:
        raise LabError(f"no exercise {n!r}: choose one of {', '.join(map(str, EXERCISES))} (python lab.py list)")
    return EXERCISES[int(n)]


# ----------------------------------------------------------------------------- reading a function with ast

def find_function(source, name):
    """The top-level `def name` of a module's source, as an ast node."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise LabError(f"no function {name} at the top level of the file")


def is_check(stmt):
    """An argument check: a call to a `check_*` helper, or `if ...: raise ValueError(...)`."""
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        return getattr(stmt.value.func, "id", "").startswith("check_")
    if not isinstance(stmt, ast.If) or stmt.orelse or len(stmt.body) != 1:
        return False
    raised = stmt.body[0]
    return (isinstance(raised, ast.Raise) and isinstance(raised.exc, ast.Call)
            and getattr(raised.exc.func, "id", "") == "ValueError")


def head_statements(func):
    """How many statements of the body a stub keeps: the docstring, then the argument checks at the
    top (an alias such as `n = group_size` between two checks stays with them)."""
    body = func.body
    kept = 1 if ast.get_docstring(func) is not None else 0
    end = kept
    for i in range(kept, len(body)):
        if is_check(body[i]):
            end = i + 1
        elif not (isinstance(body[i], ast.Assign) and isinstance(body[i].value, ast.Name)):
            break
    return end


def is_stub(func):
    """True when the body is the kept head plus a single `raise NotImplementedError(...)`."""
    rest = func.body[head_statements(func):]
    return (len(rest) == 1 and isinstance(rest[0], ast.Raise) and isinstance(rest[0].exc, ast.Call)
            and getattr(rest[0].exc.func, "id", "") == "NotImplementedError")


def function_lines(source, name):
    """(first, end) 0-based line slice of the whole function, decorators included."""
    func = find_function(source, name)
    first = min([func.lineno] + [d.lineno for d in func.decorator_list]) - 1
    return first, func.end_lineno


# ----------------------------------------------------------------------------- start, reset

def stub_source(source, n):
    """The module's source with exercise n's body replaced by its stub."""
    ex = exercise(n)
    func = find_function(source, ex.function)
    lines = source.splitlines(keepends=True)
    kept = head_statements(func)
    head = func.body[kept - 1].end_lineno if kept else func.body[0].lineno - 1
    indent = " " * func.body[0].col_offset
    message = (f"exercise {n}: write the body of {ex.function} from its docstring and "
               f"docs/method.md {ex.sections}")
    return "".join(lines[:head] + [f'{indent}raise NotImplementedError("{message}")\n'] + lines[func.end_lineno:])


def git(root, *args):
    """Run git in `root`; its stdout, or a LabError with git's own complaint."""
    done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
    if done.returncode:
        raise LabError(f"git {' '.join(args)} failed in {root}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def original_function(root, n):
    """Exercise n's function as it stands in the newest commit of its file where it is not a stub."""
    ex = exercise(n)
    for commit in git(root, "log", "--format=%H", "--", ex.file).split():
        source = git(root, "show", f"{commit}:./{ex.file}")   # ./: from root, maybe a repository subfolder
        try:
            func = find_function(source, ex.function)
        except (SyntaxError, LabError):
            continue
        if not is_stub(func):
            first, end = function_lines(source, ex.function)
            return "".join(source.splitlines(keepends=True)[first:end])
    raise LabError(f"no commit of {ex.file} holds {ex.function} unstubbed: clone the repository again")


def working_file(root, ex):
    """(path, text) of the exercise's file as it stands; a LabError naming the file if it does not parse (mid-edit)
    or no longer holds the exercise's function (renamed, deleted)."""
    path = Path(root) / ex.file
    source = path.read_text()
    back = f"take the whole file back from git with `git checkout -- {ex.file}` (other edits in it go too)"
    try:
        find_function(source, ex.function)
    except SyntaxError as error:
        raise LabError(f"{ex.file} does not parse (line {error.lineno}: {error.msg}): fix it, or {back}") from None
    except LabError:
        raise LabError(f"{ex.file} holds no top-level function {ex.function}: put it back, or {back}") from None
    return path, source


def write_whole(path, text):
    """Write `text` to a file beside `path`, then rename it onto `path`: a kill mid-write keeps the old file whole.
    (models.write_text_atomically does the same, but importing models imports transformers: seconds per call.)"""
    tmp = path.with_name(path.name + ".lab-tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def start(n, root=ROOT):
    """Write exercise n's stub into its file; a one-line report."""
    ex = exercise(n)
    path, source = working_file(root, ex)
    if is_stub(find_function(source, ex.function)):
        return f"exercise {n} is already started: {ex.file}:{ex.function} is a stub"
    first, end = function_lines(source, ex.function)
    if "".join(source.splitlines(keepends=True)[first:end]) != original_function(root, n):
        raise LabError(f"{ex.file}:{ex.function} differs from the committed one: "
                       f"keep your version, or `python lab.py reset {n}` first")
    write_whole(path, stub_source(source, n))

    def stub(other):   # only for the note: another exercise's file missing or mid-edit stops nothing
        try:
            return is_stub(find_function(working_file(root, other)[1], other.function))
        except (OSError, LabError):
            return False

    shared = [f"exercise {k} ({other.function})" for k, other in EXERCISES.items()
              if k != int(n) and {*other.tests, *other.also} & set(ex.tests) and stub(other)]   # 1, 2, 5; 3
    return (f"exercise {n} started: {ex.file}:{ex.function} now raises NotImplementedError; "
            f"`python lab.py test {n}` should fail" + (f". Note: {' and '.join(shared)} "
            f"{'is a stub and shares its' if len(shared) == 1 else 'are stubs and share their'} tests, whose failures "
            "will show too: finish or reset first (LAB.md)" if shared else ""))


def reset(n, root=ROOT):
    """Put exercise n's original function back, leaving the rest of its file alone; a one-line report. A version
    of the student's own (neither the stub nor the original) is first kept in lab/attempt-N[-K].py."""
    ex = exercise(n)
    path, source = working_file(root, ex)
    first, end = function_lines(source, ex.function)
    lines = source.splitlines(keepends=True)
    current, original = "".join(lines[first:end]), original_function(root, n)
    kept = ""
    if current != original and not is_stub(find_function(source, ex.function)):   # else silently lost
        folder = Path(root) / "lab"
        folder.mkdir(exist_ok=True)
        names = (f"attempt-{n}.py", *(f"attempt-{n}-{k}.py" for k in range(2, 10 ** 6)))
        copy = next(folder / name for name in names if not (folder / name).exists())
        copy.write_text(current)
        kept = f"; your version is kept in {copy.relative_to(root)}"
    write_whole(path, "".join(lines[:first]) + original + "".join(lines[end:]))
    return f"exercise {n} reset: {ex.file}:{ex.function} is the committed function again{kept}"


# ----------------------------------------------------------------------------- test, list

def test_command(n):
    """The command that runs every test pinning exercise n (whole files: edge cases included)."""
    return ["python", "-m", "pytest", *exercise(n).tests]


def test(n, pytest_args=(), root=ROOT):
    """Run exercise n's tests single-threaded (as the experiments); pytest's exit status."""
    command = test_command(n) + list(pytest_args)
    print("OMP_NUM_THREADS=1 " + " ".join(command), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable] + command[1:], cwd=root, env=env).returncode


def listing(root=ROOT):
    """The exercises as a Markdown table, with the state of each function in the working tree."""
    rows = ["| N | function | docs/method.md | test command | state |", "|---|---|---|---|---|"]
    for n, ex in EXERCISES.items():
        state = "started (stub)" if is_stub(find_function(working_file(root, ex)[1], ex.function)) else "written"
        rows.append(f"| {n} | `{ex.file[:-3]}.{ex.function}` | {ex.sections} | "
                    f"`python lab.py test {n}` = `{' '.join(test_command(n))}` | {state} |")
    return "\n".join(rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("action", nargs="?", choices=["list", "start", "test", "reset"])
    parser.add_argument("n", nargs="?", help="the exercise, 1 to 5 (not for list)")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="test: more arguments for pytest")
    args = parser.parse_args(argv)
    if args.action is None:
        parser.error("give an action: list, start N, test N or reset N")
    try:
        if args.action == "list":
            if args.n is not None:   # else silently the whole list: `list 3` may mean `start 3` or `test 3`
                raise LabError(f"`python lab.py list` takes no exercise number, got "
                               f"{' '.join([args.n, *args.pytest_args])}")
            print(listing())
            return 0
        if args.n is None:
            raise LabError(f"`python lab.py {args.action} N` needs an exercise number, 1 to 5")
        if args.pytest_args and (args.action != "test" or args.pytest_args[0].strip() in map(str, EXERCISES)):
            raise LabError(f"`python lab.py {args.action}` takes one exercise at a time, got {args.n} and "
                           f"{' '.join(args.pytest_args)}")
        if args.action == "test":
            exercise(args.n)
            return test(args.n, args.pytest_args)
        print((start if args.action == "start" else reset)(args.n))
        return 0
    except LabError as error:
        print(f"lab.py: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
