"""Package layering, read from the source (ast): cache/ is storage and imports neither engine/
nor scheduler/; scheduler/ decides and imports neither cache/, engine/, worker/, server/ nor
torch (tests/scheduler/test_torch_free.py runs it with torch blocked); engine/ never imports
worker/ or server/; sim/ runs the scheduler's code without torch, a model or a process."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "instgenie"

#: what pure-Python deciding code may not import: another layer, or a model stack
_PURE = ("instgenie.cache", "instgenie.engine", "instgenie.worker", "instgenie.server", "torch",
         "diffusers")  # fmt: skip
#: package -> module prefixes none of its modules may import (at any depth, lazily included)
FORBIDDEN = {
    "cache": ("instgenie.engine", "instgenie.scheduler", "instgenie.worker", "instgenie.server"),
    # scikit-learn is allowed: only inside LinearFit.fit, which the profiler calls
    "scheduler": (*_PURE, "triton", "transformers"),
    "engine": ("instgenie.worker", "instgenie.server"),
    # the simulator runs the scheduler's code, never a model or a process
    "sim": _PURE,
    # the dataset is drawn with numpy and PIL: generating it needs no model stack
    "dataset": (*_PURE, "instgenie.scheduler", "instgenie.sim", "triton", "transformers"),
}


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_stay_in_their_layer(package: str) -> None:
    bad = []
    for path in sorted((PKG / package).rglob("*.py")):
        for line, module in _imports(path):
            if any(module == p or module.startswith(p + ".") for p in FORBIDDEN[package]):
                bad.append(f"{path.relative_to(PKG.parent)}:{line} imports {module}")
    assert not bad, "\n".join(bad)


def test_only_cluster_mode_imports_ray() -> None:
    """Without --cluster nothing imports Ray: only instgenie/cluster/ may (and the server
    imports that package lazily, in cluster mode)."""
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        if path.is_relative_to(PKG / "cluster"):
            continue
        for line, module in _imports(path):
            if module == "ray" or module.startswith("ray."):
                bad.append(f"{path.relative_to(PKG.parent)}:{line} imports {module}")
            if module.startswith("instgenie.cluster") and not _inside_function(path, line):
                bad.append(f"{path.relative_to(PKG.parent)}:{line} imports {module} at import time")
    assert not bad, "\n".join(bad)


def _inside_function(path: Path, line: int) -> bool:
    """The import at `line` of `path` runs only when a function is called."""
    tree = ast.parse(path.read_text(), str(path))
    return any(
        isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.lineno <= line <= (node.end_lineno or node.lineno)
        for node in ast.walk(tree)
    )
