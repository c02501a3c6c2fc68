"""Package layering, read from the source (ast): cache/ is storage and imports neither engine/
nor scheduler/; scheduler/ decides and imports neither cache/, engine/, worker/, server/ nor
torch (tests/scheduler/test_torch_free.py runs it with torch blocked); engine/ never imports
worker/ or server/; sim/ runs the scheduler's code without torch, a model or a process."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "instgenie"

#: package -> module prefixes none of its modules may import (at any depth, lazily included)
FORBIDDEN = {
    "cache": ("instgenie.engine", "instgenie.scheduler", "instgenie.worker", "instgenie.server"),
    # scikit-learn is allowed: only inside LinearFit.fit, which the profiler calls
    "scheduler": (
        "instgenie.cache",
        "instgenie.engine",
        "instgenie.worker",
        "instgenie.server",
        "torch",
        "diffusers",
        "triton",
        "transformers",
    ),  # fmt: skip
    "engine": ("instgenie.worker", "instgenie.server"),
    # the simulator runs the scheduler's code, never a model or a process
    "sim": (
        "instgenie.cache",
        "instgenie.engine",
        "instgenie.worker",
        "instgenie.server",
        "torch",
        "diffusers",
    ),  # fmt: skip
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
