"""The import graph of the repository's packages, and DESIGN.md's layer table, read as data.

:func:`import_graph` reads every ``.py`` file of the given packages with :mod:`ast` (nothing is
imported) and returns, per module, the project modules it imports: ``import a.b`` and ``from a
import b`` name ``a.b`` when that is a module of the tree, else the deepest module of the tree
that the dotted name starts with (``from a.b import name`` names ``a.b``). Imports inside
functions count, as do those under ``if TYPE_CHECKING:``: a circle through a lazy import is still
two files that each need the other.

:func:`layer_table` parses DESIGN.md's "Layers" table: a layer per row, the paths it covers
(``where``) and the layers it may import (``may import``): a comma-separated list of layer names,
``nothing of dslab``, ``all of the above`` (``... except X, Y``), ``everything in dslab``,
``anything they re-export``, or ``(data)`` for rows that hold no code. A cell it cannot read is an
error, so the document and the check cannot drift apart silently.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path


def module_files(root: Path, packages: list[str]) -> dict[str, Path]:
    """Every module of ``packages`` (folders under ``root``) by its dotted name."""
    modules = {}
    for package in packages:
        for file in sorted((root / package).rglob("*.py")):
            parts = list(file.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = file
    return modules


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, list[str]]]:
    """``(dotted module, [names imported from it])`` for every import statement in ``tree``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            found.append((target, [alias.name for alias in node.names]))
    return found


def import_graph(root: Path, packages: list[str]) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports (module docstring)."""
    modules = module_files(root, packages)

    def deepest(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, file in modules.items():
        tree = ast.parse(file.read_text(), filename=str(file))
        edges = set()
        for target, names in _imported_names(tree, module, file.name == "__init__.py"):
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            edges.update(submodules)
            if len(submodules) < len(names) or not names:
                found = deepest(target)
                if found:
                    edges.add(found)
        edges.discard(module)
        graph[module] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: each strongly connected set of two or more modules, sorted
    (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.append(sorted(members))
    return sorted(found)


@dataclass
class Layer:
    name: str
    paths: list[str]  # folders end with "/", files do not
    may_import: set[str] | None  # None: a data row, no code


def _cell_paths(cell: str) -> list[str]:
    paths = []
    for raw in re.findall(r"`([^`]+)`", cell):
        path = raw.split("<", 1)[0]  # dslab/kernels/<family>/ -> dslab/kernels/
        if path.endswith("/") or path.endswith(".py"):
            paths.append(path)
        else:  # a module that may be a file or a package
            paths.extend([path + ".py", path + "/"])
    return paths


def layer_table(design: str) -> list[Layer]:
    """The layers of DESIGN.md's table, in its order (module docstring). Raises ValueError on a row
    or cell it cannot read, naming it."""
    section = design.split("## Layers", 1)
    if len(section) < 2:
        raise ValueError("DESIGN.md has no '## Layers' section")
    rows = [line for line in section[1].split("\n## ", 1)[0].splitlines() if line.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    if header[:2] != ["layer", "where"] or header[-1] != "may import":
        raise ValueError(f"the layer table's columns are {header}; expected layer, where, ..., may import")
    layers: list[Layer] = []
    for row in rows[2:]:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        name, where, rule = cells[0], cells[1], cells[-1]
        paths = _cell_paths(where)
        if not paths:
            raise ValueError(f"layer {name!r}: no path in its 'where' cell {where!r}")
        names = [layer.name for layer in layers]
        text = rule.replace("`", "").strip()
        if text == "(data)":
            allowed = None
        elif text == "nothing of dslab":
            allowed = set()
        elif text in ("everything in dslab", "anything they re-export"):
            allowed = {"*"}
        elif text.startswith("all of the above"):
            allowed = set(names)
            rest = text.removeprefix("all of the above").strip()
            if rest:
                if not rest.startswith("except "):
                    raise ValueError(f"layer {name!r}: cannot read 'may import' {rule!r}")
                allowed -= {n.strip() for n in rest.removeprefix("except ").split(",")}
        else:
            allowed = {n.strip().removeprefix("dslab.").removesuffix(" only").strip() for n in text.split(",")}
        if allowed is not None:
            unknown = sorted(allowed - {"*"} - set(names) - {name})
            if unknown:
                raise ValueError(f"layer {name!r} may import {unknown}, which are not layers above it in the table")
        layers.append(Layer(name, paths, allowed))
    return layers


def layer_of(relative_path: str, layers: list[Layer]) -> Layer | None:
    """The layer whose paths cover ``relative_path`` most specifically (the longest path)."""
    best, best_length = None, -1
    for layer in layers:
        for path in layer.paths:
            matches = relative_path.startswith(path) if path.endswith("/") else relative_path == path
            if matches and len(path) > best_length:
                best, best_length = layer, len(path)
    return best


def layer_violations(root: Path, graph: dict[str, set[str]], modules: dict[str, Path],
                     layers: list[Layer]) -> tuple[list[str], list[str]]:
    """``(files in no layer, imports a layer may not make)``, each as readable lines."""
    unplaced, against = [], []
    placed = {}
    for module, file in modules.items():
        relative = file.relative_to(root).as_posix()
        layer = layer_of(relative, layers)
        if layer is None or layer.may_import is None:
            unplaced.append(f"{relative}: in no layer of DESIGN.md's table")
        placed[module] = layer
    for module, targets in sorted(graph.items()):
        layer = placed[module]
        if layer is None or layer.may_import is None or "*" in layer.may_import:
            continue
        for target in sorted(targets):
            other = placed.get(target)
            if other is None or other.name == layer.name or other.name in layer.may_import:
                continue
            against.append(f"{module} ({layer.name}) imports {target} ({other.name}); "
                           f"{layer.name} may import {', '.join(sorted(layer.may_import)) or 'nothing of dslab'}")
    return unplaced, against
