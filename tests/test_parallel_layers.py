"""Import layering of DESIGN.md: `io` never imports `model`, `model` never imports `parallel` / `train` /
`serve` / `post` (EP is applied to a model from outside). Checked statically on every module's imports
(relative ones resolved), with a negative control proving the checker fires, and dynamically in fresh
interpreters (each side imports first without a partially-initialised-module error; building and running a
model loads no `k3.parallel`)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "k3"
FORBIDDEN = {"io": ("k3.model", "k3.parallel", "k3.train", "k3.serve", "k3.post"),
             "model": ("k3.parallel", "k3.train", "k3.serve", "k3.post")}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Absolute names of every module `source` (the code of `module`) imports, at any depth of the file."""
    pkg = module.split(".") if is_package else module.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = pkg[:len(pkg) - (node.level - 1)] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}  # `from . import model` imports a module too
    return out


def violations(layer: str) -> list[str]:
    bad = []
    for path in sorted((PKG / layer).rglob("*.py")):
        mod = _module_name(path)
        for name in imported_modules(path.read_text(), mod, path.name == "__init__.py"):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[layer]):
                bad.append(f"{mod} imports {name}")
    return bad


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_point_downward(layer):
    assert violations(layer) == []


def test_checker_fires_on_relative_and_absolute_imports():
    src = "def f():\n    from ..model.k3 import K3\n    import k3.parallel.moonep\n    from .. import train\n"
    names = imported_modules(src, "k3.io.checkpoint")
    assert {"k3.model.k3", "k3.parallel.moonep", "k3.train"} <= names
    assert imported_modules("from . import mxfp4", "k3.io", is_package=True) >= {"k3.io.mxfp4"}
    assert "k3.io.checkpoint" in imported_modules("from ..io.checkpoint import x", "k3.model.k3")


@pytest.mark.parametrize("first", ["k3.io.checkpoint", "k3.model.state_dict"])
def test_fresh_interpreter_imports_without_cycles(first):
    code = (f"import importlib, sys; importlib.import_module({first!r}); import k3.io.checkpoint, k3.model.state_dict;"
            "from k3 import K3Config, K3ForConditionalGeneration; import torch;"
            "cfg = K3Config.preset('k3-tiny'); cfg.vision_config = None;"
            "m = K3ForConditionalGeneration(cfg); m(torch.randint(0, 100, (1, 8)));"
            "bad = sorted(n for n in sys.modules if n.startswith(('k3.parallel', 'k3.train', 'k3.serve', 'k3.post')));"
            "assert not bad, bad; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
