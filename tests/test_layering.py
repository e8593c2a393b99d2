"""The package's modules import one another without cycles, never import a layer above
their own, and read no other module's private names: each concern sits on the ones below
it."""

import ast

from helpers import ROOT

# Private names a module may read from another, as (reading module, module read, name):
# none. Where a name is read across modules, make it public instead.
ALLOWED_PRIVATE_READS = frozenset()

# The layers, from the bottom: a module may import its own layer and those below it. An
# entry holds the modules it names and, for a subpackage, every module inside it; where
# entries nest, the longest wins (`_compiler.passes` before `_compiler`). The package
# itself holds only its `__init__`.
LAYERS = (
    ("_errors", "_config", "_dtypes"),
    ("_compat",),
    ("_mpi",),
    ("_safety",),
    ("_diagnostics",),
    ("_agreement",),
    ("_hostcalls",),
    ("_operators",),
    ("_collectives",),
    ("_compiler.jaxprs",),
    ("_inference",),
    ("_compiler.stages",),
    ("_compiler.passes",),
    ("_compiler",),
    ("_totals",),
    ("_problem",),
    ("linalg", "__main__", ""),
)


def _modules(package):
    """Find every module of a package, subpackages included.

    **Arguments:**
    - `package`: the package's directory.

    **Returns:** {dotted module name: path}.
    """
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def _from_base(modules, module, node):
    """The module an `ImportFrom` imports from.

    **Arguments:**
    - `modules`: the package's modules (see `_modules`).
    - `module`: the importing module's dotted name.
    - `node`: the `ast.ImportFrom`.

    **Returns:** its dotted name, or None outside the package.
    """
    if node.level == 0:
        base = node.module
    else:
        # Relative imports start from the package: a module's parent, an `__init__`'s own.
        package = module.split(".")
        if modules[module].name != "__init__.py":
            package = package[:-1]
        package = package[:len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
    return base if base in modules else None


def _imports(modules, module):
    """Read a module's package-internal imports, at module level and inside functions.

    **Arguments:**
    - `modules`: the package's modules (see `_modules`).
    - `module`: the dotted name of the module to read.

    **Returns:** (its syntax tree, the set of modules it imports, {local name: module it
    names}, [(line, module read, private name)] read by `from ... import`).
    """
    tree = ast.parse(modules[module].read_text(), str(modules[module]))
    imported, bound, private_reads = set(), {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name not in modules:
                    continue
                imported.add(alias.name)
                top = alias.name.split(".")[0]
                bound[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(modules, module, node)
            if base is None:
                continue
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target in modules:  # a module: `from . import _comm`
                    imported.add(target)
                    bound[alias.asname or alias.name] = target
                    continue
                imported.add(base)
                if _private(alias.name):
                    private_reads.append((node.lineno, base, alias.name))
    imported.discard(module)
    return tree, imported, bound, private_reads


def _module_named(modules, node, bound):
    """**Returns:** the package module an expression names (`_comm`, `distop._comm`), or
    None."""
    if isinstance(node, ast.Name):
        return bound.get(node.id)
    if isinstance(node, ast.Attribute):
        outer = _module_named(modules, node.value, bound)
        if outer is not None and f"{outer}.{node.attr}" in modules:
            return f"{outer}.{node.attr}"
    return None


def _graph(modules):
    """**Returns:** {module: set of the package modules it imports}."""
    return {module: _imports(modules, module)[1] for module in modules}


def _cycles(graph):
    """Find the groups of modules that import one another (Tarjan's strongly connected
    components).

    **Arguments:**
    - `graph`: {module: set of the modules it imports}.

    **Returns:** for each group, a shortest cycle through its first module (first repeated
    last) and the group's modules, sorted.
    """
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(module):
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = set()
            while True:
                other = stack.pop()
                on_stack.discard(other)
                group.add(other)
                if other == module:
                    break
            if len(group) > 1:
                groups.append(group)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return [(_cycle_in(graph, group), sorted(group)) for group in groups]


def _cycle_in(graph, group):
    """**Returns:** a shortest path through `group` from its first module back to it."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for other in sorted(graph[module] & group):
                if other == start:
                    return paths[module] + [start]
                if other not in paths:
                    paths[other] = paths[module] + [other]
                    following.append(other)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # a group always has one


def _private_reads(modules):
    """**Returns:** ["module:line uses module.name"] for each private name a module
    reads (or sets) in another, outside `ALLOWED_PRIVATE_READS`."""
    found = []
    for module in modules:
        tree, _, bound, reads = _imports(modules, module)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                read = _module_named(modules, node.value, bound)
                if read is not None and f"{read}.{node.attr}" not in modules:
                    reads.append((node.lineno, read, node.attr))
        for line, read, name in reads:
            if read != module and (module, read, name) not in ALLOWED_PRIVATE_READS:
                found.append(f"{module}:{line} uses {read}.{name}")
    return sorted(found)


def _layer_of(layers, package, module):
    """Find the layer a module belongs to.

    **Arguments:**
    - `layers`: the layers, from the bottom (see `LAYERS`).
    - `package`: the package's dotted name.
    - `module`: the module's dotted name.

    **Returns:** the layer's index, or None where no entry holds the module.
    """
    best, found = -1, None
    for index, entries in enumerate(layers):
        for entry in entries:
            named = f"{package}.{entry}" if entry else package
            holds = module == named or (entry and module.startswith(named + "."))
            if holds and len(named) > best:
                best, found = len(named), index
    return found


def _upward_imports(graph, layers, package):
    """Find the imports that go up the layers, and the modules no layer holds.

    **Arguments:**
    - `graph`: {module: set of the modules it imports}.
    - `layers`: the layers, from the bottom (see `LAYERS`).
    - `package`: the package's dotted name.

    **Returns:** ["module (layer i) imports other (layer j)"] and ["module"], sorted.
    """
    upward, placed = [], []
    for module in sorted(graph):
        mine = _layer_of(layers, package, module)
        if mine is None:
            placed.append(module)
            continue
        for other in sorted(graph[module]):
            theirs = _layer_of(layers, package, other)
            if theirs is not None and theirs > mine:
                upward.append(f"{module} (layer {mine}) imports {other} (layer {theirs})")
    return upward, placed


def test_the_checks_see_every_kind_of_import(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    for name, text in {
        "__init__.py": "from . import a\nfrom .sub import c\n",
        "a.py": "import os\nfrom . import b as bee\nbee._hidden()\nbee.__doc__\n",
        "b.py": "def f():\n    from .sub.c import g\n    return g\n",
        "sub/__init__.py": "",
        "sub/c.py": "from .. import d\nfrom ..a import _x, __all__\n",
        "d.py": "import pkg.sub.c\nimport pkg.a as A\npkg.sub.c._z\nA._w = 1\n",
        "e.py": "from pkg import sub\nsub.c._v\nsub._u\n",
    }.items():
        (package / name).write_text(text)
    modules = _modules(package)
    graph = _graph(modules)
    assert graph["pkg"] == {"pkg.a", "pkg.sub.c"}
    assert graph["pkg.b"] == {"pkg.sub.c"}  # a function-local import counts
    assert graph["pkg.sub.c"] == {"pkg.a", "pkg.d"}
    assert graph["pkg.d"] == {"pkg.sub.c", "pkg.a"}
    assert _cycles(graph) == [(["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"],
                               ["pkg.a", "pkg.b", "pkg.d", "pkg.sub.c"])]
    assert _private_reads(modules) == [
        "pkg.a:3 uses pkg.b._hidden",
        "pkg.d:3 uses pkg.sub.c._z",
        "pkg.d:4 uses pkg.a._w",
        "pkg.e:2 uses pkg.sub.c._v",
        "pkg.e:3 uses pkg.sub._u",
        "pkg.sub.c:2 uses pkg.a._x",
    ]


def test_no_import_cycles():
    cycles = _cycles(_graph(_modules(ROOT / "distop")))
    assert not cycles, "modules that import one another (function-local imports too):\n" + \
        "\n".join(f"{' -> '.join(cycle)} (all of {', '.join(group)})"
                  for cycle, group in cycles)


def test_no_module_reads_another_modules_private_names():
    found = _private_reads(_modules(ROOT / "distop"))
    assert not found, "private names read across modules (make them public):\n" + \
        "\n".join(found)


def test_the_layer_check_sees_an_upward_import():
    graph = {"pkg": {"pkg.low", "pkg.high.b"}, "pkg.low": {"pkg.high.a"},
             "pkg.high.a": {"pkg.low", "pkg.high.b"}, "pkg.high.b": set(), "pkg.stray": set()}
    layers = (("low",), ("high",), ("",))
    assert _layer_of(layers, "pkg", "pkg.high.b") == 1
    assert _layer_of(layers, "pkg", "pkg.stray") is None  # the package holds only itself
    assert _upward_imports(graph, layers, "pkg") == (
        ["pkg.low (layer 0) imports pkg.high.a (layer 1)"], ["pkg.stray"])


def test_no_module_imports_a_layer_above_its_own():
    upward, unplaced = _upward_imports(_graph(_modules(ROOT / "distop")), LAYERS, "distop")
    assert not unplaced, "modules in no layer (add them to LAYERS):\n" + "\n".join(unplaced)
    assert not upward, "imports that go up the layers (function-local imports too):\n" + \
        "\n".join(upward)
