"""The docs point at the code as it is: README.md's reading order, and every command the docs show.

Each `lines A-B name` of "Read the code in this order" must name a function of the file last mentioned that starts
at line A (its `def`, or the decorator above it) and ends at line B: a reader following the list by line numbers
lands on it. Each `python X.py ...` of README.md, LAB.md, docs/ and the scripts' docstrings must be a command line
a command line its script's parser accepts (train.py's and evaluate.py's: and `cli.check_args`): a reader who
copies one gets no usage error."""
import argparse
import ast
import importlib
import re
from itertools import takewhile
from pathlib import Path

import cli

ROOT = Path(__file__).resolve().parent.parent


def reading_order():
    """[(file, first line, last line, name)] from the README's reading-order section, in order."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Read the code in this order", 1)[1].split("\n## ", 1)[0]
    refs, current = [], None
    for match in re.finditer(r"`(\w+\.py)`|lines (\d+)-(\d+) `(\w+)`", section):
        if match.group(1):
            current = match.group(1)
        else:
            refs.append((current, int(match.group(2)), int(match.group(3)), match.group(4)))
    return refs


def functions(file):
    """{name: (first line counting decorators, def line, last line)} of every function in `file`."""
    tree = ast.parse((ROOT / file).read_text())
    return {node.name: (min([node.lineno] + [d.lineno for d in node.decorator_list]), node.lineno, node.end_lineno)
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def test_reading_order_line_numbers_name_the_functions_they_say():
    refs = reading_order()
    assert len(refs) >= 10, f"the reading order lost its references: {refs}"
    wrong = []
    for file, first, last, name in refs:
        found = functions(file).get(name)
        if found is None or first not in found[:2] or last != found[2]:
            where = "no such function" if found is None else f"lines {found[0]}-{found[2]}"
            wrong.append(f"{file} lines {first}-{last} `{name}`: the code has {where}")
    assert not wrong, "README reading order is stale:\n" + "\n".join(wrong)


# ----------------------------------------------------------------------------- the commands the docs show

SCRIPTS = ("train", "evaluate", "schedule", "bench", "report", "keeps", "bench_static", "lab")
CALL = re.compile(r"python3? (\w+)\.py\b([^`#\n|;&]*)")
PLACEHOLDERS = {"N": "1", "S": "0", "FILE.json": "results/schedule.json", "PATH": "out"}   # the docs' "any such value"


def shown_commands():
    """[(where, script, argv)] of every `python X.py ...` in the docs' code (indented or fenced) and inline code, and in the module
    docstrings of the scripts: a wrapped line or span is joined, a shell brace {a,b} or glob ? takes its first value,
    and the command ends at a redirection or at two spaces (a usage line's description)."""
    sources = [ROOT / "README.md", ROOT / "LAB.md", *sorted((ROOT / "docs").glob("*.md"))]
    texts = [(f.name, f.read_text()) for f in sources]
    texts += [(f.name, ast.get_docstring(ast.parse(f.read_text())) or "") for f in sorted(ROOT.glob("*.py"))]
    found = []
    for name, text in texts:
        text = re.sub(r"\s*\\\n\s*", " ", text)                               # a code line's continuation
        fenced = re.split(r"^```.*$", text, flags=re.M)[1::2]                  # inside ``` fences: code
        text = re.sub(r"^```.*?^```.*?$", "", text, flags=re.M | re.S)
        lines = text.splitlines()
        code = [line for line in lines if line.startswith("    ")] + "\n".join(fenced).splitlines()
        prose = "\n".join(line for line in lines if not line.startswith("    "))
        spans = [s.replace("\n", " ") for s in re.findall(r"`([^`]+)`", prose)]
        for piece in spans + code:
            for match in CALL.finditer(piece):
                if match.group(1) in SCRIPTS:
                    argv = re.split(r"\s{2,}", match.group(2).strip())[0]      # two spaces: a description follows
                    argv = re.sub(r"\{([^,}]*)[^}]*\}", r"\1", argv).replace("?", "0").split()
                    argv = list(takewhile(lambda a: not re.match(r"\d*[<>]", a), argv))   # up to a redirection
                    found.append((name, match.group(1), [PLACEHOLDERS.get(a, a) for a in argv if a != "..."]))
    return found


class Parsed(Exception):
    """Raised where a script's parser returns: the command line was accepted, and no work is done."""


def parse_only(script, argv, monkeypatch):
    """The script's own `main(argv)`, stopped as its argparse parser returns; SystemExit where argparse refuses the
    command line (an unknown flag, a bad choice or type)."""
    real = argparse.ArgumentParser.parse_args

    def stop(parser, args=None, namespace=None):
        raise Parsed(real(parser, args, namespace))

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", stop)
        try:
            importlib.import_module(script).main(argv)
        except Parsed:
            return
    raise AssertionError(f"python {script}.py {' '.join(argv)} returned without parsing its command line")


def test_every_command_the_docs_show_parses(monkeypatch, capsys):
    """A renamed or removed flag, a choice no longer offered, two flags train.py refuses together: a reader who
    copies a command from the docs gets an error. Every command is parsed by its script's own parser, and
    train.py's and evaluate.py's are checked by `cli.check_args` too, unless a data file it names is not in this
    checkout (../shared's, from a clone outside /work; a reader's own train.jsonl)."""
    monkeypatch.chdir(ROOT)                                            # the docs' paths are the repository's
    commands = shown_commands()
    assert len(commands) >= 110 and {s for _, s, _ in commands} == set(SCRIPTS), "the docs' commands went missing"
    wrong = []
    for where, script, argv in commands:
        try:
            if script in ("train", "evaluate"):
                if script == "evaluate":                                 # train.py's evaluate-only run
                    argv = ["--steps", "0", *argv]
                args = cli.parse_args(argv)
                if all(path is None or Path(path).is_file() for path in (args.data, args.eval_data)):
                    cli.check_args(args)
            else:
                parse_only(script, argv, monkeypatch)
        except (SystemExit, ValueError) as error:
            if getattr(error, "code", 1) == 0:                        # --help
                continue
            message = capsys.readouterr().err.strip().splitlines()[-1:] or [str(error)]
            wrong.append(f"{where}: python {script}.py {' '.join(argv)}: {message[0]}")
    assert not wrong, "commands the docs show that their script refuses:\n" + "\n".join(wrong)
