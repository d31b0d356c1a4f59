"""The arrows between the rooms, enforced: collector imports nothing of ours; the engine does not
import the watchdog; root cause does not import the feedback loop; only the composition root
(meshscope/: the CLI, the sidecar, the launcher) wires rooms together. Every import of ours goes
through the one import name, `meshscope`."""

import ast
from pathlib import Path

import pytest

from tests.test_structure import ROOMS as CHECKED

REPO = Path(__file__).resolve().parents[1]
ROOMS = [room for room in CHECKED if room != "meshscope"]  # pyproject's list, read once
ALLOWED = {
    "collector": set(),
    "trainer": {"collector"},
    "tracer": {"collector"},
    "detectors": {"collector"},
    "watchdog": {"collector"},
    "explain": {"collector", "detectors"},
    "feedback": {"collector"},
    "alerts": {"collector"},
    "dashboards": {"collector", "detectors", "alerts"},
    "view": {"collector", "explain", "feedback", "advisor"},
    "advisor": {"collector"},
}
OLD_NAMES = set(ROOMS)  # the pre-package top-level names: importing one bypasses `meshscope`


def _imported(path: Path) -> set[str]:
    """Dotted names `path` imports, at any depth (lazy imports count too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def rooms_imported(room: str) -> dict[str, set[str]]:
    """Rooms of ours each file of `room` imports, other than itself."""
    out = {}
    for path in (REPO / room).rglob("*.py"):
        found = {n.split(".")[1] for n in _imported(path) if n.startswith("meshscope.") and n.count(".") >= 1}
        out[str(path.relative_to(REPO))] = found - {room}
    return out


def test_every_room_has_its_arrows():
    assert set(ALLOWED) == set(ROOMS), f"say what {set(ROOMS) ^ set(ALLOWED)} may import"


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_imports_point_one_way(room):
    wrong = {
        f: sorted(found - ALLOWED[room]) for f, found in rooms_imported(room).items() if found - ALLOWED[room]
    }
    assert not wrong, f"{room} may import only {sorted(ALLOWED[room])} of ours: {wrong}"


def test_no_room_imports_the_composition_root():
    """Nothing imports the CLI, the sidecar, the launcher or the worker entry but the root itself."""
    root = {"cli", "sidecar", "launcher", "worker", "config", "alerting"}
    wrong = {
        f: sorted(found & root)
        for room in ALLOWED
        for f, found in rooms_imported(room).items()
        if found & root
    }
    assert not wrong, wrong


@pytest.mark.parametrize("folder", [*ROOMS, "meshscope", "tests", "benchmarks", "fixtures"])
def test_every_import_goes_through_the_one_name(folder):
    bare = {
        str(path.relative_to(REPO)): sorted(n for n in _imported(path) if n.split(".")[0] in OLD_NAMES)
        for path in (REPO / folder).rglob("*.py")
        if "stores" not in path.relative_to(REPO).parts
    }
    bare = {f: names for f, names in bare.items() if names}
    assert not bare, f"import meshscope.<room>, not <room>: {bare}"


def test_the_contract_sees_every_room():
    """A new room must be placed in ALLOWED (and in pyproject's package list) on purpose."""
    folders = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"meshscope", "tests", "fixtures"}
    assert folders == set(ALLOWED), folders ^ set(ALLOWED)


def test_tests_and_benchmarks_share_fixtures_not_each_other():
    """What both need (recorded runs, fault programs) lives in fixtures/; neither imports the other."""
    crossing = {}
    for folder, other in (("tests", "benchmarks"), ("benchmarks", "tests")):
        for path in (REPO / folder).rglob("*.py"):
            if path == Path(__file__).resolve():
                continue  # this test reads both folders by design
            text = path.read_text()
            names = _imported(path)
            if any(n.split(".")[0] == other for n in names) or f'/ "{other}"' in text:
                crossing[str(path.relative_to(REPO))] = other
    benchmark_modules = {p.stem for p in (REPO / "benchmarks").glob("*.py")}
    for path in (REPO / "tests").rglob("*.py"):
        if _imported(path) & benchmark_modules:
            crossing[str(path.relative_to(REPO))] = sorted(_imported(path) & benchmark_modules)
    assert not crossing, crossing
