"""The package arrows of the design, enforced: collector imports nothing of ours; trainer,
tracer and detectors import collector; dashboards imports collector and detectors; only the
CLI (meshscope/) wires everything together."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OURS = {"collector", "trainer", "tracer", "detectors", "dashboards", "meshscope"}
ALLOWED = {
    "collector": set(),
    "trainer": {"collector"},
    "tracer": {"collector"},
    "detectors": {"collector"},
    "dashboards": {"collector", "detectors"},
    "meshscope": OURS,
}


def imports_of(package: str) -> dict[str, set[str]]:
    """Our packages each file of `package` imports (at any depth: lazy imports count too)."""
    out = {}
    for path in (REPO / package).rglob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                else []
            )
            found |= {n.split(".")[0] for n in names} & OURS
        out[str(path.relative_to(REPO))] = found - {package}
    return out


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_one_way(package):
    wrong = {
        f: sorted(found - ALLOWED[package])
        for f, found in imports_of(package).items()
        if found - ALLOWED[package]
    }
    assert not wrong, f"{package} may import only {sorted(ALLOWED[package])}: {wrong}"
