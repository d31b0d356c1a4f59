"""Each install extra imports: its modules load with every distribution its requirements (from
pyproject.toml, followed through installed metadata) do not pull in hidden, as in a clean venv
holding only that extra. A module that imports what its extra does not install fails here."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]

# What each part's user imports.
MODULES = {
    "": [
        "collector",
        "meshscope.collector.monitor",
        "meshscope.collector.store",
        "meshscope.collector.metrics",
        "meshscope.collector.exporter",
    ],
    "detectors": [
        "meshscope.detectors.engine",
        "meshscope.detectors.live",
        "meshscope.explain.ranking",
        "meshscope.feedback.loop",
        "meshscope.watchdog.watch",
        "meshscope.watchdog.diagnose",
        "meshscope.detectors.series",
        "meshscope.collector.report",
        "meshscope.collector.controls",
        "meshscope.cli",
    ],
    "trainer": [
        "meshscope.trainer.loop",
        "meshscope.trainer.worker",
        "meshscope.trainer.controls",
        "tracer",
        "meshscope.launcher",
        "meshscope.cli",
    ],
    "view": ["meshscope.view.data", "meshscope.view.ui", "meshscope.view.settings", "streamlit", "plotly"],
    "stack": [
        "meshscope.dashboards.stack",
        "meshscope.dashboards.boards",
        "meshscope.dashboards.publish",
        "meshscope.dashboards.compose",
        "meshscope.dashboards.postgres",
    ],
    "jobstore": ["meshscope.collector.storedb", "psycopg"],
    "hf": ["meshscope.collector.hf", "transformers", "accelerate"],
    "lightning": ["meshscope.collector.lightning", "lightning"],
}

CHECK = textwrap.dedent("""
    import importlib, importlib.metadata as md, importlib.util, json, re, sys
    from packaging.requirements import Requirement

    extra, modules, project_reqs = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()

    def wanted(reqs, extras):
        for text in reqs:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras or [""]):
                yield req

    allowed, todo = set(), list(project_reqs[""])
    todo += project_reqs.get(extra, []) if extra else []
    while todo:
        text = todo.pop()
        req = Requirement(text)
        if norm(req.name) == "meshscope":  # an extra naming others
            for e in req.extras:
                todo += project_reqs[e]
            continue
        if norm(req.name) in allowed:
            continue
        allowed.add(norm(req.name))
        try:
            todo += [str(r) for r in wanted(md.requires(req.name) or [], req.extras)]
        except md.PackageNotFoundError:
            pass
    owners = md.packages_distributions()
    hidden = {top for top, dists in owners.items()
              if not any(norm(d) in allowed or norm(d) == "meshscope" for d in dists)}

    class Hide:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in hidden:
                raise ModuleNotFoundError(f"No module named {name!r} (not installed by this extra)",
                                          name=name)
            return None

    sys.meta_path.insert(0, Hide())
    # a probe for an optional package (its spec, or its installed version, as torchmetrics
    # asks for scipy) must see it absent, not installed but broken
    real_find_spec, real_distribution = importlib.util.find_spec, md.distribution
    importlib.util.find_spec = lambda name, package=None: (
        None if name.split(".")[0] in hidden else real_find_spec(name, package))
    hidden_dists = {norm(d) for dists in owners.values() for d in dists} - allowed - {"meshscope"}

    def distribution(name):
        if norm(name) in hidden_dists:
            raise md.PackageNotFoundError(name)
        return real_distribution(name)

    md.distribution = distribution
    for module in modules:
        importlib.import_module(module)
    print("ok", len(allowed), "distributions")
""")


def _requirements() -> dict[str, list[str]]:
    return {"": PROJECT["dependencies"], **PROJECT["optional-dependencies"]}


@pytest.mark.parametrize("extra", list(MODULES), ids=lambda e: e or "core")
def test_each_extra_imports_with_only_what_it_installs(extra):
    out = subprocess.run(
        [sys.executable, "-c", CHECK, extra, json.dumps(MODULES[extra]), json.dumps(_requirements())],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]


def test_all_holds_every_part_and_make_installs_it():
    extras = PROJECT["optional-dependencies"]
    assert set(extras) >= set(MODULES) - {""} | {"all"}
    assert "meshscope[trainer,view,stack,jobstore]" in extras["all"]
    assert "'.[all,test]'" in (REPO / "Makefile").read_text()


def test_the_hiding_works():
    """The check can fail: the core does not install pandas, so importing it must fail."""
    out = subprocess.run(
        [sys.executable, "-c", CHECK, "", json.dumps(["pandas"]), json.dumps(_requirements())],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode != 0 and "not installed by this extra" in out.stderr
