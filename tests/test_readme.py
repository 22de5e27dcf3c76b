"""README.md: its "Read the code in this order" list points at the code as it is.

Each `lines A-B name` there must name a function of the file last mentioned that starts at line A (its
`def`, or the decorator above it) and ends at line B: a reader following the list by line numbers lands on it."""
import ast
import re
from pathlib import Path

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
