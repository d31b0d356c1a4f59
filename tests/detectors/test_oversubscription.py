"""Ranks that outnumber the cores take turns on them: the host is named once, and no rank is
blamed for what sharing explains; a rank slower than sharing explains is still a straggler."""

import subprocess

import pytest

from fixtures.runs import MESHSCOPE, TINY
from meshscope.collector.env import HostShare
from meshscope.collector.store import load_events
from meshscope.detectors.engine import DetectionEngine
from meshscope.explain.ranking import explain
from tests.detectors.test_engine import synthetic_run

SHARED = HostShare(cores=2, ranks=4, threads=1)


def test_the_share_of_a_host():
    assert SHARED.factor == 2.0 and SHARED.oversubscribed
    assert not HostShare(cores=8, ranks=4, threads=2).oversubscribed
    assert "oversubscribed" in SHARED.describe() and "no rank is blamed" in SHARED.describe()
    assert HostShare.from_detail(SHARED.detail()) == SHARED
    assert HostShare.from_detail({"cores": "x"}) is None


def _stragglers(df, host):
    found = []
    engine = DetectionEngine(on_close=found.append)
    if host is not None:
        engine.judge_against(host)
    for end in range(10, df["step"].max() + 11, 10):
        engine.process(df[df["step"] < end])
    engine.finish()
    return [e for e in found if e.type == "straggler"]


@pytest.mark.parametrize(
    "start, factor, host, expected",
    [(50, 2.2, None, True), (0, 2.2, SHARED, False), (50, 2.2, SHARED, True), (50, 6.0, SHARED, True)],
)
def test_stragglers_are_judged_against_the_hosts_sharing(start, factor, host, expected):
    """A rank 2.2x its peers is a straggler on its own cores. On a shared host a rank that
    was always 2.2x its peers is what taking turns on 2 cores explains; one that turns 2.2x
    slower than its own pace while its peers keep theirs is more than this host's measured
    noise (3 %) explains, and is named; 6x anywhere."""
    df = synthetic_run(slow=(2, start, 90, factor))
    assert bool(_stragglers(df, host)) == expected


def test_a_run_on_too_few_cores_says_so_once_and_blames_no_rank(tmp_path):
    """Two ranks pinned to one core (taskset), whatever this machine has: the summary names the
    host, the store holds its `host` event, and root cause blames the host, not a rank."""
    out = subprocess.run(
        ["taskset", "-c", "0", *MESHSCOPE, "run", "--config", str(TINY), "--run-dir", str(tmp_path)]
        + ["--run-id", "shared", "--steps", "60"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    # the time account names its buckets, a `straggler` one among them: that blames no rank
    said = [line for line in out.stdout.splitlines() if not line.startswith("where the time went")]
    text = " ".join(" ".join(said).split())
    assert text.count("oversubscribed") == 1 and "2 rank(s) x 1 thread(s) on 1 core(s)" in text, text[-1500:]
    assert "straggler" not in text, text[-1500:]
    hosts = load_events(tmp_path / "shared", kind="host")
    assert [d["cores"] for d in hosts["detail"]] == [1]
    causes = explain(tmp_path / "shared")
    assert not any(c.kind == "slow_host" for c in causes), causes
