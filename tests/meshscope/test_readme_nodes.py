"""The README's several-machines lines, run as they are: two network namespaces as two machines
(each its own folder, its own ports, a default route), the job store from `stack up --store`
on node A, the same `meshscope run` line on both nodes, then `explain` on each node naming a
slow rank that runs on node B. What is replaced: `nodeA` by node A's address and the two `--store`
flags by the ones `stack up` printed; what is appended: a tiny model, fewer steps, 2 ranks a
node and the slow rank's injection."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fixtures.netns import nodes
from fixtures.runs import REPO, TINY

pytestmark = pytest.mark.e2e
STEPS = 60
APPENDED = (
    f"--config {TINY} --nproc 2 --steps {STEPS} --set elastic.checkpoint_every=10 "
    "--inject slow@step=30,rank=3,steps=20,factor=4"
)


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


def test_the_readme_several_machines_lines_train_one_job_and_explain_names_a_rank_of_the_other_node(tmp_path):
    up, run, explain = readme_commands()
    assert up == "meshscope stack up --store" and run.startswith("meshscope run ") and "explain" in explain
    # not under pytest's folder, which is private to root: the server runs as `postgres`
    root = Path(tempfile.mkdtemp(prefix="meshscope-readme-"))
    root.chmod(0o711)
    (tmp_path / "nodes").symlink_to(root)  # where a failing run's folders are found
    homes = [root / "nodeA", root / "nodeB"]
    for home in homes:
        home.mkdir()
    with nodes(2) as (a, b):
        started = _shell(a, up, homes[0], timeout=120)
        try:
            assert started.returncode == 0, started.stdout + started.stderr
            printed = r"runs write to it with: (--store \S+ --store-password-file \S+)"
            flags = re.search(printed, started.stdout)
            assert flags and a.address in flags[1], started.stdout  # an address node B reaches
            line = re.sub(r"--store \S+ --store-password-file \S+", flags[1], run.replace("nodeA", a.address))
            agents = [
                subprocess.Popen(
                    node.command("bash", "-c", f"{line} {APPENDED}"),
                    cwd=home,
                    env=_user_env(),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                for node, home in zip((a, b), homes, strict=True)
            ]
            outs = [agent.communicate(timeout=300)[0] for agent in agents]
            for agent, out in zip(agents, outs, strict=True):
                assert agent.returncode == 0, out[-3000:]
                at = max(out.find("Traceback"), out.find("frame #0"))
                assert at < 0, out[max(0, at - 2500) : at + 500]  # no Python or C++ traceback
            for node, home in zip((a, b), homes, strict=True):  # either node reads the whole job
                said = _shell(node, explain, home)
                assert said.returncode == 0, said.stdout + said.stderr
                first = said.stdout.split("\n2. ")[0]
                assert "rank 3" in first and "slow" in first, f"{node.name}: {said.stdout[-2000:]}"
        finally:
            _shell(a, "meshscope stack down", homes[0], timeout=60)
