"""Print issue 36's design measures over gateway/ and backends/ as one table, read with the stdlib `ast` module.

Measures: import cycles (strongly connected components of the module import graph, counting imports inside functions
and leaving out those under `if TYPE_CHECKING:`), uses of `Any`, getattr/hasattr calls, and functions over 60 and 80
lines with the longest. An import edge goes to the module named, or for `from pkg import name` to `pkg.name` when that
is a module; a package's `__init__` is not counted as imported by its submodules (that re-export pattern is not a
design cycle). Run: `.venv/bin/python scripts/design_measures.py [--cycles] [--long N] [--root DIR]`.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
TREES = ("gateway", "backends")


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    is_package: bool
    imports: set[str] = field(default_factory=set)
    lines: dict[str, int] = field(default_factory=dict)  # imported module -> the first line importing it


def module_name(path: Path, root: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def load(root: Path, trees: tuple[str, ...]) -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for top in trees:
        for path in sorted((root / top).rglob("*.py")):
            name, is_package = module_name(path, root)
            modules[name] = Module(name, path.relative_to(root), ast.parse(path.read_text(), str(path)), is_package)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _import_nodes(node: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement under `node`, at any depth, except the bodies of `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            found.append(child)
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                found.extend(_import_nodes(ast.Module(body=[stmt], type_ignores=[])))
        else:
            found.extend(_import_nodes(child))
    return found


def _resolve_base(mod: Module, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = mod.name.split(".") if mod.is_package else mod.name.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    if node.module:
        base.append(node.module)
    return ".".join(base)


def resolve_imports(modules: dict[str, Module]) -> None:
    for mod in modules.values():
        for node in _import_nodes(mod.tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _resolve_base(mod, node)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            for target in targets:
                if target in modules and target != mod.name:
                    mod.imports.add(target)
                    mod.lines.setdefault(target, node.lineno)


def cycles(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative), largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(modules):
        if start in index:
            continue
        work: list[tuple[str, list[str]]] = [(start, sorted(modules[start].imports))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, pending = work[-1]
            if pending:
                nxt = pending.pop()
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(modules[nxt].imports)))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found, key=lambda c: (-len(c), c))


def any_uses(tree: ast.Module) -> int:
    count = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "Any":
            count += 1
        elif isinstance(node, ast.Attribute) and node.attr == "Any":
            count += 1
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "Any" in node.value:
            count += _string_annotation_any(node.value)
    return count


def _string_annotation_any(text: str) -> int:
    """`Any` inside a quoted annotation such as "dict[str, Any]"; a string that does not parse is prose, not a type."""
    try:
        expr = ast.parse(text, mode="eval")
    except SyntaxError:
        return 0
    return sum(1 for node in ast.walk(expr) if isinstance(node, ast.Name) and node.id == "Any")


def probe_calls(tree: ast.Module) -> int:
    return sum(
        1
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
    )


def functions(mod: Module) -> list[tuple[int, str]]:
    """(lines, "path::Qual.name") for every function and method, nested ones included (an outer one counts them)."""
    out: list[tuple[int, str]] = []
    rel = mod.path.as_posix()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qual = f"{prefix}{child.name}"
                out.append(((child.end_lineno or child.lineno) - child.lineno + 1, f"{rel}::{qual}"))
                visit(child, f"{qual}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(mod.tree, "")
    return out


@dataclass
class Measures:
    modules: int
    edges: dict[str, dict[str, int]]  # module -> {imported module: line}
    cycles: list[list[str]]
    any_uses: int
    probes: int
    funcs: list[tuple[int, str]]  # longest first


def measure(root: Path, trees: tuple[str, ...]) -> Measures:
    modules = load(root, trees)
    resolve_imports(modules)
    return Measures(
        modules=len(modules),
        edges={m.name: m.lines for m in modules.values()},
        cycles=cycles(modules),
        any_uses=sum(any_uses(m.tree) for m in modules.values()),
        probes=sum(probe_calls(m.tree) for m in modules.values()),
        funcs=sorted((f for m in modules.values() for f in functions(m)), reverse=True),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", action="store_true", help="list each import cycle's modules and the imports between them")
    ap.add_argument("--long", type=int, default=5, help="how many of the longest functions to list (default 5)")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout to measure (default: this one), e.g. a "
                    "`git archive <commit> gateway backends | tar -x -C DIR` export for a before/after")
    args = ap.parse_args(argv)

    both = measure(args.root, TREES)
    columns = {**{top: measure(args.root, (top,)) for top in TREES}, "both": both}
    cols = list(columns)
    rows: list[tuple[str, list[str], str]] = []

    def row(label: str, fn: Callable[[Measures], int], target: str) -> None:
        rows.append((label, [str(fn(m)) for m in columns.values()], target))

    row("modules", lambda m: m.modules, "")
    row("import cycles (SCCs)", lambda m: len(m.cycles), "0")
    row("modules in cycles", lambda m: sum(len(c) for c in m.cycles), "0")
    row("uses of Any", lambda m: m.any_uses, "<= 150")
    row("getattr/hasattr calls", lambda m: m.probes, "<= 30")
    row("functions over 60 lines", lambda m: sum(1 for n, _ in m.funcs if n > 60), "")
    row("functions over 80 lines", lambda m: sum(1 for n, _ in m.funcs if n > 80), "0")
    row("longest function (lines)", lambda m: m.funcs[0][0] if m.funcs else 0, "<= 80")

    width = max(len(r[0]) for r in rows)
    print(f"| {'measure'.ljust(width)} | " + " | ".join(c.rjust(8) for c in cols) + " | target |")
    print(f"|{'-' * (width + 2)}|" + "|".join("-" * 10 for _ in cols) + "|--------|")
    for label, values, target in rows:
        print(f"| {label.ljust(width)} | " + " | ".join(v.rjust(8) for v in values) + f" | {target.ljust(6)} |")

    print(f"\nlongest functions (gateway/ and backends/, {args.long}):")
    for lines, where in both.funcs[: args.long]:
        print(f"  {lines:4d}  {where}")
    if args.cycles:
        print("\nimport cycles:")
        for comp in both.cycles:
            print(f"  {len(comp)}: " + " <-> ".join(comp))
            for name in comp:
                for target, line in sorted(both.edges[name].items()):
                    if target in comp:
                        print(f"      {name}:{line} -> {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
