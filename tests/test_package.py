"""One import name: the wheel installs exactly one top-level package, `meshscope`, with every
room under it, and pyproject's package list matches the folders on disk."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_the_package_list_matches_the_rooms_on_disk():
    listed = set(SETUPTOOLS["packages"])
    rooms = {f"meshscope.{p.parent.name}" for p in REPO.glob("*/__init__.py")} - {"meshscope.meshscope"}
    rooms -= {"meshscope.tests", "meshscope.fixtures"}
    subpackages = {
        "meshscope." + ".".join(p.parent.relative_to(REPO / "meshscope").parts)
        for p in REPO.glob("meshscope/*/__init__.py")
    }
    assert listed == {"meshscope"} | rooms | subpackages
    assert all(SETUPTOOLS["package-dir"][f"meshscope.{r.split('.')[1]}"] for r in rooms)


def _source_copy(dest: Path) -> Path:
    """What the wheel is built from (a copy: building in the checkout would leave build/ there)."""
    (dest / "meshscope").mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, dest / name)
    for folder in {p.split(".")[-1] for p in SETUPTOOLS["packages"]} - {"meshscope"}:
        src = REPO / SETUPTOOLS["package-dir"].get(f"meshscope.{folder}", f"meshscope/{folder}")
        shutil.copytree(src, dest / src.relative_to(REPO), ignore=shutil.ignore_patterns("__pycache__"))
    for path in (REPO / "meshscope").glob("*.py"):
        shutil.copy(path, dest / "meshscope" / path.name)
    return dest


def test_the_wheel_installs_one_top_level_package(tmp_path):
    source = _source_copy(tmp_path / "src")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=240,
        cwd=source,
    )
    (wheel,) = tmp_path.glob("meshscope-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"meshscope"}, tops
    top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["meshscope"]
    # every room and its data travel: the CLI, the view's pages, the rules and boards
    for needed in (
        "meshscope/cli/__main__.py",
        "meshscope/collector/monitor.py",
        "meshscope/watchdog/__init__.py",
        "meshscope/view/screens/run.py",
        "meshscope/dashboards/rules/rules.yml",
        "meshscope/dashboards/grafana/dashboards/training.json",
        "meshscope/advisor/examples/h100.toml",
    ):
        assert needed in names, needed


def test_a_checkout_imports_without_being_installed(tmp_path):
    """PYTHONPATH=<checkout> (a lent machine, a quick try): the rooms load from the folders."""
    code = (
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]\n"
        "sys.path_hooks[:] = [h for h in sys.path_hooks if 'editable' not in repr(h)]\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "import meshscope.watchdog.verdicts, meshscope.collector.rundir\n"
        "print(meshscope.watchdog.verdicts.__file__)\n"
        "import importlib.util\n"  # only the rooms: the checkout's other folders stay its own
        "print([n for n in ('meshscope.tests', 'meshscope.fixtures', 'meshscope.benchmarks')"
        " if importlib.util.find_spec(n) is not None])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == [str(REPO / "watchdog" / "verdicts.py"), "[]"], out.stdout


def test_the_installed_package_holds_only_the_rooms():
    """Through the editable install too: `meshscope.<room>` for each room, nothing else of the
    checkout (its tests and fixtures import under their own names)."""
    import importlib.util

    for name in ("meshscope.tests", "meshscope.fixtures", "meshscope.benchmarks"):
        assert importlib.util.find_spec(name) is None, name
    assert importlib.util.find_spec("meshscope.advisor") is not None
