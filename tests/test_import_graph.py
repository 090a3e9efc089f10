"""The import graph of ``dslab/`` and ``dashboards/``: no two files import each other, directly or
round a circle, and every import keeps to the layer order of DESIGN.md's table (read from the
document itself, :mod:`import_graph`). The checker is tested on small made-up trees first, so a
passing check on the repository means something."""

from pathlib import Path

import pytest

from import_graph import circles, import_graph, layer_table, layer_violations, module_files

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["dslab", "dashboards"]


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


TABLE = """# design

## Layers

| layer | where | what it owns | may import |
| --- | --- | --- | --- |
| low | `pkg/low/` | the bottom | nothing of dslab |
| mid | `pkg/mid/`, `pkg/single` | the middle | low |
| top | `pkg/top.py` | the top | all of the above |
| data | `data/` | files | (data) |

## Next
"""


def test_a_circle_through_a_lazy_import_is_found(tmp_path):
    root = _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import thing\n",
        "pkg/b.py": "def f():\n    from pkg import c\n",
        "pkg/c.py": "import pkg.a\n",
        "pkg/d.py": "from pkg.a import thing\n",  # into the circle, not part of it
    })
    graph = import_graph(root, ["pkg"])
    assert graph["pkg.b"] == {"pkg.c"}  # `from pkg import c` names the submodule, not pkg/__init__
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_relative_and_type_checking_imports_count(tmp_path):
    root = _tree(tmp_path, {
        "pkg/__init__.py": "from .sub import x\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/x.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ...pkg import y\n",
        "pkg/y.py": "from . import sub\nfrom .sub.x import name\n",
    })
    graph = import_graph(root, ["pkg"])
    assert graph["pkg"] == {"pkg.sub.x"}
    assert graph["pkg.y"] == {"pkg.sub", "pkg.sub.x"}
    assert circles(graph) == []


def test_imports_against_the_table_and_unplaced_files_are_reported(tmp_path):
    root = _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/low/__init__.py": "",
        "pkg/low/base.py": "from pkg.mid import helper\n",  # upward: low may import nothing
        "pkg/mid/__init__.py": "",
        "pkg/mid/helper.py": "from pkg.low import base\nimport pkg.top\n",  # the second goes up
        "pkg/single.py": "from pkg.low.base import x\n",
        "pkg/top.py": "from pkg.mid.helper import y\nfrom pkg import single\n",
    })
    layers = layer_table(TABLE)
    assert [(layer.name, layer.may_import) for layer in layers] == [
        ("low", set()), ("mid", {"low"}), ("top", {"low", "mid"}), ("data", None)]
    modules = module_files(root, ["pkg"])
    unplaced, against = layer_violations(root, import_graph(root, ["pkg"]), modules, layers)
    assert unplaced == ["pkg/__init__.py: in no layer of DESIGN.md's table"]
    assert against == [
        "pkg.low.base (low) imports pkg.mid.helper (mid); low may import nothing of dslab",
        "pkg.mid.helper (mid) imports pkg.top (top); mid may import low",
    ]


@pytest.mark.parametrize("cell, message", [
    ("sometimes", "not layers above it"),
    ("all of the above but not low", "cannot read"),
    ("top", "not layers above it"),
])
def test_a_cell_the_checker_cannot_read_is_an_error(cell, message):
    broken = TABLE.replace("| the middle | low |", f"| the middle | {cell} |")
    with pytest.raises(ValueError, match=message):
        layer_table(broken)


def test_dslab_and_the_dashboards_have_no_import_circle():
    found = circles(import_graph(ROOT, PACKAGES))
    assert found == [], "files that import each other (directly or round a circle):\n" + "\n".join(
        " -> ".join(circle) for circle in found)


def test_every_import_keeps_to_design_md_layer_order():
    layers = layer_table((ROOT / "DESIGN.md").read_text())
    assert {"report", "kernels", "comm", "engine", "bench", "dashboards"} <= {layer.name for layer in layers}
    modules = module_files(ROOT, PACKAGES)
    unplaced, against = layer_violations(ROOT, import_graph(ROOT, PACKAGES), modules, layers)
    assert unplaced == [], "\n".join(unplaced)
    assert against == [], "\n".join(against)


def test_kernel_modules_sit_in_their_family_folders():
    """``dslab/kernels/`` holds the shared dispatch, grid, launch, kernel-pinning and register-audit
    modules; every op is in a family."""
    top = sorted(p.name for p in (ROOT / "dslab" / "kernels").glob("*.py"))
    assert top == ["__init__.py", "_autotuners.py", "_grid.py", "_launch.py", "_triton_compat.py", "dispatch.py",
                   "pinning.py", "register_audit.py"]
    import dslab.kernels as kernels

    families = sorted(p.name for p in (ROOT / "dslab" / "kernels").iterdir() if (p / "__init__.py").is_file())
    assert families == sorted(kernels.FAMILIES)
    tests = sorted(p.name for p in (ROOT / "tests" / "kernels").iterdir() if p.is_dir() and p.name != "__pycache__")
    assert tests == families  # each family's tests in a folder of its name


def test_every_public_op_is_in_its_module_and_the_flat_name_says_where():
    import importlib

    import dslab.kernels as kernels

    assert set(kernels.OPS) <= set(kernels.OP_MODULES)
    for op, module in kernels.OP_MODULES.items():
        assert callable(getattr(importlib.import_module(f"dslab.kernels.{module}"), op)), op
    with pytest.raises(AttributeError, match=r"dslab.kernels.layer_norm is in dslab.kernels.norm.layer_norm: "
                                             r"from dslab.kernels.norm.layer_norm import layer_norm"):
        kernels.layer_norm  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'no_such_op'"):
        kernels.no_such_op  # noqa: B018
    assert callable(kernels.attention.attention.attention)  # the family, its module, the op
