"""The numbered blocks of a module list folded into one node, for the module treemaps of the
Flops and Memory tabs.

A transformer's module tree repeats one block per layer (``layers.0`` ... ``layers.47``), each
with the same children. A treemap of every module draws every block and everything in it (~500
boxes for GPT-2 1.5B), which took Plotly half a second of a page load to lay out, and showed
little that one box per kind of module does not: the blocks hold the same flops and the same
activations, and the table beside each treemap lists (Flops) or folds (Memory) the modules too.
So the treemaps draw the blocks folded: each dotted part of a module's name that is a number
becomes ``*`` (``layers.*.attention`` is the attention of every block), the figures that add up
(flops, bytes, time) are summed over the modules a node folds, and the node counts them.

Pure functions over lists of tree nodes (dicts with ``id``, ``parent`` and ``label``, parents
before children), like :mod:`dashboards.views`.
"""

from __future__ import annotations

import re

# A dotted part of a name that is a number: at the start or after a dot, before a dot, the end,
# or the space of an own-ops node's id (``layers.3 (own ops)``).
NUMBERED_PART = re.compile(r"(?:^|(?<=\.))\d+(?=\.|$|\s)")


def folded_name(name: str) -> str:
    """``name`` with each numbered dotted part as ``*``: ``layers.3.mlp`` -> ``layers.*.mlp``,
    ``layers.3 (own ops)`` -> ``layers.* (own ops)``; other names unchanged."""
    return NUMBERED_PART.sub("*", name)


def _sum(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def fold_tree(nodes: list[dict], sums: tuple[str, ...], size: str) -> list[dict]:
    """``nodes`` with the nodes of one folded name (:func:`folded_name` of their ``id``) merged
    into one, in the order their names first appear (so parents still come before children).

    A merged node keeps its first member's other fields; its ``id`` and ``parent`` are folded,
    ``count`` is how many nodes it merges, and each field of ``sums`` is their sum (None when no
    member has one). A node whose own name ends in a folded number is labelled with its folded
    name and count (``layers.* (48 blocks)``). Then, from the leaves up, each parent's ``size``
    is raised to the sum of its children's where that is more (sums of floats in another order
    can differ in the last bit), so that a treemap drawn with ``branchvalues="total"`` holds."""
    merged: dict[str, dict] = {}
    members: dict[str, list[dict]] = {}
    for node in nodes:
        key = folded_name(node["id"])
        if key not in merged:
            merged[key] = {**node, "id": key, "parent": folded_name(node["parent"]) if node["parent"] else ""}
            members[key] = []
        members[key].append(node)
    for key, node in merged.items():
        mine = members[key]
        node["count"] = len(mine)
        for field in sums:
            node[field] = _sum([m.get(field) for m in mine])
        if len(mine) > 1 and key.endswith("*"):
            node["label"] = f"{'.'.join(key.split('.')[-2:])} ({len(mine)} blocks)"
    children: dict[str, list[dict]] = {}
    for node in merged.values():
        if node["parent"]:
            children.setdefault(node["parent"], []).append(node)
    for node in reversed(list(merged.values())):  # children after parents: leaves first
        below = sum(c[size] or 0 for c in children.get(node["id"], ()))
        if children.get(node["id"]) and below > (node[size] or 0):
            node[size] = below
    return list(merged.values())


def folds_any(nodes: list[dict]) -> bool:
    """Whether some node of a :func:`fold_tree` result merges more than one module."""
    return any(n.get("count", 1) > 1 for n in nodes)
