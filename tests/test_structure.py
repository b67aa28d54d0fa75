"""The package's structure holds: no import cycle among funcshard's modules (every import
counts: top level, inside functions, under TYPE_CHECKING), no private name (``_x``) taken
across folders, no module over 500 lines, no function over 60 (its docstring and nested
functions not counted). Read from the source alone: nothing is imported or run."""

from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "funcshard"
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 500, 60


def modname(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def graph(pkg: str) -> dict:
    root = Path(pkg).resolve()
    files = {modname(root, f): f for f in sorted(root.rglob("*.py"))}
    edges = {m: {} for m in files}
    for mod, f in files.items():
        is_pkg = f.name == "__init__.py"
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                for a in node.names:
                    sub = f"{src}.{a.name}"
                    targets.append(sub if sub in files else src)
            for t in targets:
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    edges[mod].setdefault(t, node.lineno)
    return edges


def sccs(edges: dict) -> list:
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in edges:
        if v not in index:
            visit(v)
    return [c for c in out if len(c) > 1]


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def folder(mod: str, is_pkg: bool) -> str:
    return mod if is_pkg else mod.rpartition(".")[0]


def resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private_name_hits(pkg: str) -> list[str]:
    root = Path(pkg).resolve()
    files = sorted(root.rglob("*.py"))
    modules = {}
    for f in files:
        modules[modname(root, f)] = f.name == "__init__.py"
    hits = []
    for f in files:
        mod = modname(root, f)
        is_pkg = modules[mod]
        here = folder(mod, is_pkg)
        tree = ast.parse(f.read_text(), str(f))
        aliases = {}  # local name -> module it names
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                src = resolve(mod, is_pkg, node)
                if not src.startswith(root.name):
                    continue
                for a in node.names:
                    full = f"{src}.{a.name}"
                    if full in modules:  # a submodule
                        aliases[a.asname or a.name] = full
                        there = folder(full, modules[full])
                        if private(a.name) and folder(src, modules.get(src, True)) != here:
                            hits.append((f, node.lineno, f"module {full}"))
                        continue
                    there = folder(src, modules.get(src, False))
                    if private(a.name) and there != here:
                        hits.append((f, node.lineno, f"{src}.{a.name}"))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith(root.name) and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and private(node.attr):
                chain = []
                cur = node.value
                while isinstance(cur, ast.Attribute):
                    chain.append(cur.attr)
                    cur = cur.value
                if not isinstance(cur, ast.Name):
                    continue
                if cur.id in aliases:
                    target = ".".join([aliases[cur.id]] + chain[::-1])
                elif cur.id == root.name:
                    target = ".".join([root.name] + chain[::-1])
                else:
                    continue
                if target not in modules:
                    continue
                full = f"{target}.{node.attr}"
                there = (
                    folder(full, modules[full])
                    if full in modules
                    else folder(target, modules[target])
                )
                if there != here:
                    hits.append((f, node.lineno, full))
    hits += _attribute_hits(root, files)
    return [f"{f.relative_to(root.parent)}:{line}: {what}" for f, line, what in sorted(set(hits))]


def _attribute_hits(root: Path, files: list) -> list:
    """Heuristic for `obj._x` where `_x` (a method, attribute, function or class) is defined
    only in other folders of the package: private members reached across folders."""
    defs, uses = {}, []
    for f in files:
        here = str(f.parent.relative_to(root.parent))
        for n in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defs.setdefault(n.name, set()).add(here)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                defs.setdefault(n.attr, set()).add(here)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                defs.setdefault(n.id, set()).add(here)
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and private(n.attr):
                uses.append((f, n.lineno, here, n.attr))
    return [
        (f, line, f"attribute .{name} (defined only in {', '.join(sorted(defs[name]))})")
        for f, line, here, name in uses
        if name in defs and here not in defs[name]
    ]


def _function_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    lines = set(range(fn.lineno, fn.end_lineno + 1))
    first = fn.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        if isinstance(first.value.value, str):  # the docstring
            lines -= set(range(first.lineno, first.end_lineno + 1))
    for sub in ast.walk(fn):
        if sub is not fn and isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines -= set(range(sub.lineno, sub.end_lineno + 1))
    return len(lines)


def test_no_import_cycle() -> None:
    assert sccs(graph(str(PKG))) == []


def test_no_private_name_across_folders() -> None:
    assert private_name_hits(str(PKG)) == []


def test_no_long_module_or_function() -> None:
    long = []
    for path in sorted(PKG.rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long.append(f"{path.name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = _function_lines(node)
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{os.path.relpath(path, PKG)}:{node.name}: {n} lines")
    assert long == []


# The house by role: each folder imports only folders below it (the package's top level
# above them all), read from the imports alone.
FLOORS = (
    ("distributed",),
    ("parallel",),
    ("layout",),
    ("comm", "optim"),
    ("state",),
    ("fault",),
    ("step",),
    ("checkpoint", "planner"),
)
MAX_LOOSE_MODULES = 8


def _floor(module: str) -> int:
    parts = module.split(".")
    if len(parts) < 2 or (PKG / f"{parts[1]}.py").is_file():
        return len(FLOORS)  # the top level: __init__, __main__, testing
    return next(i for i, names in enumerate(FLOORS) if parts[1] in names)


def test_every_folder_has_a_floor_and_a_docstring() -> None:
    folders = sorted(p.name for p in PKG.iterdir() if (p / "__init__.py").exists())
    assert folders == sorted(n for names in FLOORS for n in names)
    for name in folders:
        doc = ast.get_docstring(ast.parse((PKG / name / "__init__.py").read_text()))
        assert doc, f"funcshard/{name}/__init__.py: a docstring saying what the folder is"


def test_folders_import_only_downward() -> None:
    up = [
        f"{mod} -> {target}"
        for mod, targets in graph(str(PKG)).items()
        for target in targets
        if _floor(target) > _floor(mod)
    ]
    assert up == []


def test_few_loose_modules() -> None:
    loose = sorted(p.name for p in PKG.glob("*.py"))
    assert len(loose) <= MAX_LOOSE_MODULES, loose


def _code_names(path: Path) -> set[str]:
    """The identifiers a module's code uses (names, attributes, arguments, definitions and
    imports; not its strings, comments or docstrings)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update(a.name for a in node.names)
            out.add(getattr(node, "module", None) or "")
    return out


def test_fault_tolerance_lives_in_its_folder() -> None:
    """Quorums, heals and torchft are the fault folder's words: the step and init reach them
    through the guard a state holds."""
    words = ("quorum", "heal", "torchft", "Replicas")
    outside = {
        str(p.relative_to(PKG)): sorted(n for n in _code_names(p) if any(w in n for w in words))
        for p in PKG.rglob("*.py")
        if p.parent.name != "fault"
    }
    assert {p: names for p, names in outside.items() if names} == {}


def test_no_layer_branches_on_the_tensor_axis() -> None:
    """A layer asks the model-parallel axis (``parallel/axis.py``'s protocol); it never tests
    whether there is one."""
    branch = re.compile(r"tensor is (not )?None|isinstance\([^)]*TensorParallel")
    hits = [
        f"{p.relative_to(PKG)}:{i}"
        for p in PKG.rglob("*.py")
        if p.parent.name != "parallel"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if branch.search(line)
    ]
    assert hits == []


def test_no_test_module_imports_another() -> None:
    tests = Path(__file__).resolve().parent
    hits = []
    for path in sorted(tests.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            hits += [f"{path.name}: {n}" for n in names if n.startswith("test_")]
    assert hits == []


def test_checkpoints_touch_storage_through_one_module() -> None:
    """``funcshard/checkpoint/storage.py`` alone opens, lists, removes or syncs files (a path
    or an object store): the others only compose paths."""
    path_ok = {"join", "basename", "dirname", "split", "relpath"}  # composing, never touching
    hits = []
    for path in sorted((PKG / "checkpoint").glob("*.py")):
        if path.name == "storage.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            bad = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                bad = node.func.id if node.func.id == "open" else None
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id == "shutil" or (
                    node.value.id == "os"
                    and node.attr not in ("path", "fspath", "PathLike", "environ", "sep", "curdir")
                ):
                    bad = f"{node.value.id}.{node.attr}"
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Attribute)
                and isinstance(node.value.value, ast.Name)
                and node.value.value.id == "os"
                and node.value.attr == "path"
                and node.attr not in path_ok
            ):
                bad = f"os.path.{node.attr}"
            if bad:
                hits.append(f"{path.name}:{node.lineno}: {bad}")
    assert hits == []
