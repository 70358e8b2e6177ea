"""
Counts what issue 28 limits in the package's architecture, and fails above the limits.

    python3 tests/archcheck.py [-v] [ROOT]

ROOT is the project root (the folder that holds C{llmport_agent/}); by default the one this
file lives in. It prints three numbers, with the details under C{-v}, and exits 1 when one
is above its limit (C{LIMITS}); C{tests/test_architecture.py} runs it in the suite and
C{tox -e arch} on its own. The definitions, exactly:

Import loops
    The graph has one node per module of C{llmport_agent} (a package is its C{__init__.py})
    and an edge M -> N for every import statement in M that names N, wherever it stands:
    at the top, inside a function, under C{if TYPE_CHECKING:}. C{import a.b.c} names
    C{a.b.c}; C{from P import n} names C{P.n} where that is a module, else C{P}; relative
    imports are resolved against M's package; an import of a module outside the package
    adds no edge. (The parent packages an import runs are not edges: their
    C{__init__.py} files are facades that import down, never up.) An import loop is a
    strongly connected component of more than one module. Components made only of modules
    of the stand-in backend C{llmport_agent/devbackend} are listed apart and not counted.

Private reaches
    An attribute C{x._name} (a name with one or more leading underscores that is not a
    dunder C{__name__}), read, written or deleted, in any module of C{llmport_agent}, where
    C{x} is not the object's own C{self}, C{cls} or C{super()}. So C{other._state},
    C{self._peer._state}, C{module._helper} and C{ctypes._Pointer} all count; C{self._x}
    does not. (C{getattr(x, "_name")} is not parsed as an attribute and is not counted.)
    The few documented public APIs whose names begin with an underscore
    (C{PUBLIC_UNDERSCORE}: C{os._exit}) are listed apart and not counted.
    The tests (C{tests/}) are not scanned. The modules of C{ADAPTERS} are the one place
    each for a third-party library's private names where it has no public API: their
    reaches are listed apart, under the library's name, and not counted.

Top-level entries
    The names directly under C{llmport_agent/}, except C{__pycache__}.
"""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Iterable
from pathlib import Path

PACKAGE = "llmport_agent"
#: The stand-in backend: its internal loops are not counted.
STAND_IN = f"{PACKAGE}.devbackend"
#: Fails above these (issue 28).
LIMITS = {"import loops": 0, "private reaches": 30, "top-level entries": 20}
#: Allowlisted adapters: module path (relative to the root) -> the library whose private
#: names it alone may use, because that library has no public API for what we need.
ADAPTERS = {
    f"{PACKAGE}/workloads/dockerapi.py": "docker-py",
    f"{PACKAGE}/core/twistedapi.py": "Twisted",
}
#: Public, documented APIs whose names begin with an underscore (the expression exactly):
#: listed apart, not counted. C{os._exit} is the standard library's documented immediate exit.
PUBLIC_UNDERSCORE = {"os._exit": "the standard library's documented immediate exit"}
_OWN = ("self", "cls")


def find_modules(root: Path) -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    out: dict[str, Path] = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _nearest(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, tree: ast.AST, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """The package's modules that C{name} imports anywhere in C{tree}."""
    here = name.split(".") if is_package else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _nearest(alias.name, modules)
                if target:
                    found.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                target = submodule if submodule in modules else _nearest(source, modules)
                if target:
                    found.add(target)
    found.discard(name)
    return found


def components(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterable[str]]] = []
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        work.append((start, iter(sorted(graph.get(start, ())))))
        while work:
            v, edges = work[-1]
            advanced = False
            for w in edges:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def _is_private(attr: str) -> bool:
    return attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))


def _is_own(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in _OWN
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "super"
    )


def private_reaches(tree: ast.AST) -> list[tuple[int, str]]:
    """C{(line, expression)} of every C{x._name} in C{tree} with C{x} not the own object."""
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr) and not _is_own(node.value):
            hits.append((node.lineno, ast.unparse(node)[:80]))
    return sorted(hits)


class Report:
    """The measurements of one tree."""

    def __init__(self, root: Path) -> None:
        modules = find_modules(root)
        graph: dict[str, set[str]] = {}
        #: module -> its reaches (counted ones only)
        self.reaches: dict[str, list[tuple[int, str]]] = {}
        #: (module, line, expression) of the uses of C{PUBLIC_UNDERSCORE}
        self.public: list[tuple[str, int, str]] = []
        #: adapter module -> (library, its reaches)
        self.adapters: dict[str, tuple[str, list[tuple[int, str]]]] = {}
        for name, path in modules.items():
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            graph[name] = imports_of(name, tree, path.name == "__init__.py", modules)
            hits = []
            for line, text in private_reaches(tree):
                if text in PUBLIC_UNDERSCORE:
                    self.public.append((name, line, text))
                else:
                    hits.append((line, text))
            rel = path.relative_to(root).as_posix()
            if rel in ADAPTERS:
                self.adapters[name] = (ADAPTERS[rel], hits)
            elif hits:
                self.reaches[name] = hits
        loops = components(graph)

        def stand_in(mod: str) -> bool:
            return mod == STAND_IN or mod.startswith(STAND_IN + ".")

        self.loops = [c for c in loops if not all(stand_in(m) for m in c)]
        self.stand_in_loops = [c for c in loops if all(stand_in(m) for m in c)]
        self.entries = sorted(e for e in os.listdir(root / PACKAGE) if e != "__pycache__")

    def counts(self) -> dict[str, int]:
        return {
            "import loops": len(self.loops),
            "private reaches": sum(len(h) for h in self.reaches.values()),
            "top-level entries": len(self.entries),
        }

    def over(self) -> list[str]:
        """The measures above their limits, as C{"name: n > limit"}."""
        return [
            f"{what}: {n} > {LIMITS[what]}"
            for what, n in self.counts().items()
            if n > LIMITS[what]
        ]

    def lines(self, verbose: bool) -> list[str]:
        counts = self.counts()
        out = [f"import loops: {counts['import loops']} (limit {LIMITS['import loops']})"]
        if verbose:
            out += ["  " + " <-> ".join(c) for c in self.loops]
            out += [
                "  (stand-in backend, not counted) " + " <-> ".join(c)
                for c in self.stand_in_loops
            ]
        out.append(
            f"private reaches: {counts['private reaches']} "
            f"(limit {LIMITS['private reaches']})"
        )
        if verbose:
            for name, hits in sorted(self.reaches.items(), key=lambda kv: (-len(kv[1]), kv[0])):
                out.append(f"  {len(hits)} {name}")
                out += [f"      {line}: {text}" for line, text in hits]
        adapted = sum(len(h) for _lib, h in self.adapters.values())
        out.append(f"allowlisted adapters: {len(self.adapters)}, {adapted} reaches not counted")
        for name, (library, hits) in sorted(self.adapters.items()):
            out.append(f"  {name} ({library}): {len(hits)}")
            if verbose:
                out += [f"      {line}: {text}" for line, text in hits]
        out.append(f"documented public underscore names: {len(self.public)} uses, not counted")
        if verbose:
            out += [f"  {name}:{line}: {text}" for name, line, text in sorted(self.public)]
        out.append(
            f"top-level entries: {counts['top-level entries']} "
            f"(limit {LIMITS['top-level entries']})"
        )
        if verbose:
            out.append("  " + " ".join(self.entries))
        return out


def main(argv: list[str]) -> int:
    verbose = "-v" in argv
    rest = [a for a in argv if a != "-v"]
    if any(a.startswith("-") for a in rest) or len(rest) > 1:
        print("usage: archcheck.py [-v] [ROOT]", file=sys.stderr)
        return 2
    root = Path(rest[0]) if rest else Path(__file__).resolve().parent.parent
    if not (root / PACKAGE).is_dir():
        print(f"{root} has no {PACKAGE}/ folder: pass the project root.", file=sys.stderr)
        return 2
    report = Report(root)
    print("\n".join(report.lines(verbose)))
    over = report.over()
    if over:
        print("over the limits: " + "; ".join(over) + " (details: archcheck.py -v)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
