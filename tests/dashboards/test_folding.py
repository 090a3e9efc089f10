"""The numbered blocks folded into one node for the module treemaps (dashboards/folding.py): names,
sums and counts, a parent never below its children (``branchvalues="total"``), and the Flops and
Memory treemaps of the committed GPT-2 reports drawn folded, every flop and byte still in them,
while the Flops table keeps every module."""

from __future__ import annotations

import random
import re
from pathlib import Path

import dash_ag_grid as dag
import pytest
from dash import dcc

from dashboards import figures, flops_view, memory_view
from dashboards.flops_tab import flops_tab
from dashboards.folding import fold_tree, folded_name
from dslab.report import frames, read_report

TRAINING = Path(__file__).parent / "fixtures" / "training_reports" / "gpt2"
FLOPS_RUN = TRAINING / "20261127T050756Z-85c737"  # GPT-2 124M and 1.5B, device-timed modules
MEMORY_RUN = TRAINING / "20261126T100551Z-d7b758"  # GPT-2 1.5B with the memory tracer's activations
NUMBERED = re.compile(r"(^|\.)\d+(\.|$| )")


@pytest.mark.parametrize("name, folded", [
    ("layers.3.mlp", "layers.*.mlp"), ("layers.47", "layers.*"), ("layers.3 (own ops)", "layers.* (own ops)"),
    ("0.attn.12.proj", "*.attn.*.proj"), ("(root)", "(root)"), ("(root) (own ops)", "(root) (own ops)"),
    ("h2.conv1d", "h2.conv1d"), ("blocks.1a.mlp", "blocks.1a.mlp"), ("(outside modules)", "(outside modules)"),
])
def test_a_numbered_part_of_a_name_folds_to_a_star(name, folded):
    assert folded_name(name) == folded


def _blocks_tree(rng: random.Random, blocks: int) -> list[dict]:
    """A model whose module list holds ``blocks`` blocks of two children each, values random floats;
    each parent exactly the float sum of its children, as the treemaps' nodes are."""
    nodes = [{"id": "(root)", "parent": "", "label": "(root)", "v": 0.0},
             {"id": "layers", "parent": "(root)", "label": "layers", "v": 0.0}]
    for b in range(blocks):
        a, c = rng.uniform(0, 1), rng.uniform(0, 1e-3)
        nodes += [{"id": f"layers.{b}", "parent": "layers", "label": str(b), "v": a + c},
                  {"id": f"layers.{b}.attn", "parent": f"layers.{b}", "label": "attn", "v": a},
                  {"id": f"layers.{b}.mlp", "parent": f"layers.{b}", "label": "mlp", "v": c}]
    nodes[1]["v"] = sum(n["v"] for n in nodes if n["parent"] == "layers")
    nodes[0]["v"] = nodes[1]["v"]
    return nodes


def test_fold_tree_sums_counts_and_keeps_every_parent_at_least_its_children():
    raised = 0
    for seed in range(200):
        nodes = _blocks_tree(random.Random(seed), blocks=48)
        folded = fold_tree(nodes, ("v",), "v")
        by_id = {n["id"]: n for n in folded}
        assert list(by_id) == ["(root)", "layers", "layers.*", "layers.*.attn", "layers.*.mlp"]  # parents first
        assert by_id["layers.*"]["count"] == 48 and by_id["layers.*"]["label"] == "layers.* (48 blocks)"
        assert by_id["layers.*.attn"]["label"] == "attn" and by_id["layers.*.attn"]["parent"] == "layers.*"
        assert by_id["layers.*.attn"]["v"] == pytest.approx(sum(n["v"] for n in nodes if n["id"].endswith(".attn")))
        blocks = by_id["layers.*"]
        plain_sum = sum(n["v"] for n in nodes if n["parent"] == "layers")
        children = by_id["layers.*.attn"]["v"] + by_id["layers.*.mlp"]["v"]
        raised += children > plain_sum  # the sum in another order came out larger: raised to it
        for parent in folded:
            below = [n["v"] for n in folded if n["parent"] == parent["id"]]
            if below:
                assert parent["v"] >= sum(below) and parent["v"] == pytest.approx(sum(below), rel=1e-12)
        assert blocks["v"] == pytest.approx(plain_sum, rel=1e-12) and by_id["(root)"]["count"] == 1
    assert raised > 0  # the case the raise exists for occurs among these draws


@pytest.fixture(scope="module")
def gpt2_flops():
    report = read_report(FLOPS_RUN)
    records = {m["name"]: m for m in report.profilers["flops"]["1.5b"]["modules"]}
    nodes = flops_view.flops_tree(frames.flops_modules(report, case="1.5b", strict=True))
    return report, records, nodes


def test_the_flops_treemap_folds_the_48_blocks_and_keeps_every_flop(gpt2_flops):
    report, records, nodes = gpt2_flops
    full = flops_view.treemap_nodes(nodes)
    folded = flops_view.folded_treemap_nodes(nodes)
    by_id = {n["id"]: n for n in folded}
    assert len(by_id) == len(folded) and len(folded) < 20 < len(full)
    assert not any(NUMBERED.search(n["id"]) for n in folded)
    blocks = [name for name in records if re.fullmatch(r"layers\.\d+", name)]
    assert len(blocks) == 48 and by_id["layers.*"]["count"] == 48 and by_id["layers.*"]["label"] == "layers.* (48 blocks)"
    assert by_id["(root)"]["flops"] == next(n["flops"] for n in full if n["id"] == "(root)")
    # every flop is in some leaf once: the leaves add up to the model
    parents = {n["parent"] for n in folded}
    leaves = sum(n["flops"] for n in folded if n["id"] not in parents)
    assert leaves == pytest.approx(by_id["(root)"]["flops"], rel=1e-9)
    for parent in folded:
        below = [n["flops"] for n in folded if n["parent"] == parent["id"]]
        if below:
            assert parent["flops"] >= sum(below)
    # a folded module: the flops and device time of its 48 modules, its TFLOP/s that of the sums
    attention = [records[f"{b}.attention"] for b in blocks]
    flops = sum(m["forward_flops"] + m["backward_flops"] for m in attention)
    ms = sum(m["forward_device_ms"] + m["backward_device_ms"] for m in attention)
    node = by_id["layers.*.attention"]
    assert node["count"] == 48 and node["flops"] == pytest.approx(flops) and node["latency_ms"] == pytest.approx(ms)
    assert node["tflops"] == pytest.approx(flops / (ms * 1e-3) / 1e12)
    own = by_id["layers.*.attention (own ops)"]
    assert own["type"] == "ops of layers.*.attention outside its submodules" and own["count"] == 48
    fig = figures.flops_treemap(folded, "1.5b")
    assert "numbered blocks folded" in fig.layout.title.text
    assert list(fig.data[0].customdata[list(fig.data[0].ids).index("layers.*")])[-1] == "48 modules, summed"


def test_the_flops_tab_draws_the_folded_tree_beside_every_module(gpt2_flops):
    report, records, _ = gpt2_flops
    out = flops_tab(report, "gpt2", report.run_id, "1.5b")
    found = {}

    def walk(node):
        if isinstance(node, (dcc.Graph, dag.AgGrid)):
            found[node.id] = node
        children = getattr(node, "children", None)
        for child in children if isinstance(children, list) else [children] if children is not None else []:
            if not isinstance(child, str):
                walk(child)

    for top in out:
        walk(top)
    ids = list(found["flops-treemap"].figure.data[0].ids)
    assert "layers.*.mlp" in ids and "layers.0" not in ids
    assert len(found["flops-modules"].rowData) == len(records)  # the table: every module
    assert "layers.47.mlp" in {r["module"] for r in found["flops-modules"].rowData}


def test_the_activation_treemap_folds_the_blocks_and_keeps_every_byte():
    report = read_report(MEMORY_RUN)
    nodes = memory_view.activation_tree(frames.memory_activations(report, case="1.5b", strict=True))
    folded = memory_view.folded_activation_nodes(nodes)
    by_id = {n["id"]: n for n in folded}
    full = {n["id"]: n for n in nodes}
    assert by_id["(root)"]["bytes"] == full["(root)"]["bytes"] and len(folded) < 30 < len(nodes)
    assert by_id["layers.*"]["count"] == 48
    fc_out = [n for n in nodes if re.fullmatch(r"layers\.\d+\.mlp\.fc_out", n["id"])]
    assert by_id["layers.*.mlp.fc_out"]["bytes"] == sum(n["bytes"] for n in fc_out)
    assert by_id["layers.*.mlp.fc_out"]["own_bytes"] == sum(n["own_bytes"] for n in fc_out)
    for n in folded:  # integers: a parent is exactly its own bytes and its children's
        assert n["bytes"] == n["own_bytes"] + sum(c["bytes"] for c in folded if c["parent"] == n["id"])
    fig = memory_view.activation_treemap(folded, "1.5b")
    assert list(fig.data[0].ids) == [n["id"] for n in folded] and "numbered blocks folded" in fig.layout.title.text
    assert "numbered blocks folded" not in memory_view.activation_treemap(nodes, "1.5b").layout.title.text
