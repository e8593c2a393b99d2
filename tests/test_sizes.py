"""Every module, class and function of the package is small enough to read in one sitting:
no module over 600 lines, no class over 350, no function over 60."""

import ast

from helpers import ROOT

MODULE_LINES = 600
CLASS_LINES = 350
FUNCTION_LINES = 60


def _body_lines(node):
    """Count a class's or function's lines, from its first statement after the docstring
    to its last line.

    **Arguments:**
    - `node`: the `ast.ClassDef`, `ast.FunctionDef` or `ast.AsyncFunctionDef`.

    **Returns:** the count.
    """
    body = node.body
    if len(body) > 1 and ast.get_docstring(node, clean=False) is not None:
        body = body[1:]
    return node.end_lineno - body[0].lineno + 1


def _oversized(package):
    """Find the modules, classes and functions over their limits.

    **Arguments:**
    - `package`: the package's directory.

    **Returns:** ["path: what name has n lines (limit m)"], sorted.
    """
    found = []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        where = path.relative_to(package.parent)
        lines = len(text.splitlines())
        if lines > MODULE_LINES:
            found.append(f"{where}: module has {lines} lines (limit {MODULE_LINES})")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.ClassDef):
                what, limit = "class", CLASS_LINES
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                what, limit = "function", FUNCTION_LINES
            else:
                continue
            count = _body_lines(node)
            if count > limit:
                found.append(f"{where}:{node.lineno}: {what} {node.name} has {count} lines "
                             f"(limit {limit})")
    return sorted(found)


def _function(name, statements, docstring=True):
    """**Returns:** the source of a function of `statements` lines after its docstring."""
    doc = ['    """A docstring,', '    of two lines."""'] if docstring else []
    return "\n".join([f"def {name}():"] + doc + ["    x = 1"] * statements) + "\n"


def test_the_size_check_counts_from_the_first_statement_after_the_docstring(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "fits.py").write_text(_function("at_the_limit", FUNCTION_LINES))
    (package / "long.py").write_text(
        _function("one_over", FUNCTION_LINES + 1, docstring=False)
        + "class Big:\n" + "    y = 2\n" * (CLASS_LINES + 1)
        + "\n" * (MODULE_LINES - CLASS_LINES - FUNCTION_LINES - 3))
    assert _oversized(package) == [
        f"pkg/long.py: module has {MODULE_LINES + 1} lines (limit {MODULE_LINES})",
        f"pkg/long.py:1: function one_over has {FUNCTION_LINES + 1} lines "
        f"(limit {FUNCTION_LINES})",
        f"pkg/long.py:{FUNCTION_LINES + 3}: class Big has {CLASS_LINES + 1} lines "
        f"(limit {CLASS_LINES})",
    ]


def test_no_module_class_or_function_is_over_its_limit():
    found = _oversized(ROOT / "distop")
    assert not found, "split these into steps or modules a reader can name:\n" + \
        "\n".join(found)
