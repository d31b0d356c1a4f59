"""The README's several-machines lines, run as they are: two network namespaces as two machines
(each its own folder, its own ports, a default route), the job store from `stack up --store`
on node A, the same `meshscope run` line on both nodes, then `explain` on each node naming a
slow rank that runs on node B. What is replaced: `nodeA` by node A's address and the two `--store`
flags by the ones `stack up` printed; what is appended: a tiny model, fewer steps, 2 ranks a
node and the slow rank's injection."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fixtures.netns import nodes
from fixtures.runs import REPO, TINY
from meshscope.collector.store import load_events, load_steps

pytestmark = pytest.mark.e2e
STEPS = 60
APPENDED = f"--config {TINY} --nproc 2 --steps {STEPS} --checkpoint-every 10"


def readme_commands() -> list[str]:
    """The shell lines of the job store's block, continuations joined, comments dropped."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("### One job store for all nodes") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S)[1]
    joined = block.replace("\\\n", " ")
    lines = [line for line in joined.splitlines() if line.strip() and not line.startswith("#")]
    return [" ".join(line.split()) for line in lines]


def _user_env() -> dict[str, str]:
    """A user's shell: `meshscope` on the PATH, no interface forced (the tests' own loopback)."""
    env = dict(os.environ, PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
    env.pop("GLOO_SOCKET_IFNAME", None)
    return env


def _shell(node, line: str, cwd, timeout: float = 300) -> subprocess.CompletedProcess:
    command = node.command("bash", "-c", line)
    return subprocess.run(command, cwd=cwd, env=_user_env(), capture_output=True, text=True, timeout=timeout)


@contextlib.contextmanager
def readme_job(tmp_path) -> Iterator[tuple]:
    """Two nodes, node A's `stack up --store` as the README has it: (nodes, their folders, the
    README's run line for them, its explain line). The stack goes down on the way out."""
    up, run, explain = readme_commands()
    assert up == "meshscope stack up --store" and run.startswith("meshscope run ") and "explain" in explain
    # not under pytest's folder, which is private to root: the server runs as `postgres`
    root = Path(tempfile.mkdtemp(prefix="meshscope-readme-"))
    root.chmod(0o711)
    (tmp_path / "nodes").symlink_to(root)  # where a failing run's folders are found
    homes = [root / "nodeA", root / "nodeB"]
    for home in homes:
        home.mkdir()
    with nodes(2) as pair:
        started = _shell(pair[0], up, homes[0], timeout=120)
        try:
            assert started.returncode == 0, started.stdout + started.stderr
            printed = r"runs write to it with: (--store \S+ --store-password-file \S+)"
            flags = re.search(printed, started.stdout)
            assert flags and pair[0].address in flags[1], started.stdout  # an address node B reaches
            line = re.sub(
                r"--store \S+ --store-password-file \S+", flags[1], run.replace("nodeA", pair[0].address)
            )
            yield pair, homes, line, explain
        finally:
            _shell(pair[0], "meshscope stack down", homes[0], timeout=60)
            shutil.rmtree(root, ignore_errors=True)


def _agent(node, home, line: str) -> subprocess.Popen:
    """The run line on one node, its output read as it comes (`lines`)."""
    proc = subprocess.Popen(
        node.command("bash", "-c", line),
        cwd=home,
        env=_user_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    proc.lines = []
    threading.Thread(target=lambda: proc.lines.extend(proc.stdout), daemon=True).start()
    return proc


def _ended(proc: subprocess.Popen, timeout: float = 300) -> str:
    """Wait for an agent; its whole output, which must hold no Python or C++ traceback."""
    proc.wait(timeout=timeout)
    time.sleep(0.2)  # the reader's last lines
    out = "".join(proc.lines)
    assert proc.returncode == 0, out[-3000:]
    at = max(out.find("Traceback"), out.find("frame #0"))
    assert at < 0, out[max(0, at - 2500) : at + 500]
    return out


def test_the_readme_several_machines_lines_train_one_job_and_explain_names_a_rank_of_the_other_node(tmp_path):
    # 4 ranks share 2 cores: the straggler rule scales its line by that sharing (x2) and by
    # the noise its ranks' normal steps showed, and with the whole suite on 2 cores a normal
    # step is at times descheduled for 10x its compute (a full run missed 10x twice): 30x
    # stands out whatever else the machine runs
    slow = "--inject slow@step=30,rank=3,steps=20,factor=30"
    with readme_job(tmp_path) as ((a, b), homes, line, explain):
        agents = [
            _agent(node, home, f"{line} {APPENDED} {slow}") for node, home in zip((a, b), homes, strict=True)
        ]
        for agent in agents:
            _ended(agent)
        for node, home in zip((a, b), homes, strict=True):  # either node reads the whole job
            said = _shell(node, explain, home)
            assert said.returncode == 0, said.stdout + said.stderr
            assert "where the time went" in said.stdout and "ETTR" in said.stdout, said.stdout[-2000:]
            first = said.stdout.split("\n2. ")[0]
            if not ("rank 3" in first and "slow" in first):
                pytest.fail(f"{node.name}: {said.stdout[-2000:]}\n{_faults(homes[0] / 'runs' / 'job1')}")


def _faults(run) -> str:
    """What the job recorded of deaths and hangs: why a verdict other than the slow rank came first."""
    events = load_events(run)
    faults = events[events["kind"].isin(["hang", "fault", "restart", "run_end"])]
    return faults[["kind", "rank", "step", "time", "detail"]].to_string()


def test_a_node_lost_and_back_the_survivor_says_what_it_waits_for_and_the_job_resumes(tmp_path):
    """Node B loses power mid-run (every process in it killed); node A says, while it waits,
    what for; the same line started again on node B brings the job back from a checkpoint, and
    the job store holds every step once."""
    with readme_job(tmp_path) as ((a, b), homes, line, _):
        run = f"{line} {APPENDED}"
        survivor, lost = _agent(a, homes[0], run), _agent(b, homes[1], run)
        deadline = time.monotonic() + 120
        while not (homes[0] / "runs" / "job1" / "checkpoints" / "step_00000020").exists():
            assert survivor.poll() is None and time.monotonic() < deadline, "".join(survivor.lines)[-3000:]
            time.sleep(0.2)
        for pid in subprocess.run(
            ["ip", "netns", "pids", b.name], capture_output=True, text=True
        ).stdout.split():
            subprocess.run(["kill", "-9", pid], capture_output=True)
        lost.wait(timeout=30)
        deadline = time.monotonic() + 60
        while not any("waiting at" in x for x in survivor.lines):
            assert survivor.poll() is None and time.monotonic() < deadline, "".join(survivor.lines)[-3000:]
            time.sleep(0.2)
        back = _agent(b, homes[1], run)
        out = _ended(survivor)
        _ended(back)
        steps = load_steps(homes[0] / "runs" / "job1")  # the job store, from this machine
    every = list(range(STEPS))
    assert steps.groupby("rank")["step"].apply(list).to_dict() == dict.fromkeys(range(4), every)
    waited = next(x for x in survivor.lines if "waiting at" in x)
    assert f"{a.address}:29400" in waited and "2 node(s)" in waited, waited
    assert "resume" in out or "resumes" in out, out[-2000:]
