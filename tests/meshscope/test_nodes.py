"""A job across emulated nodes: each node a network namespace with its own address and its own
run folder (no shared file system), one `meshscope run` agent in each."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from fixtures.netns import nodes
from fixtures.ports import free_port_range
from fixtures.runs import REPO, TINY
from meshscope.collector.store import load_events, load_steps


def agents(tmp_path, steps: int = 12, *extra: str):
    """Two nodes x two ranks, node 0 hosting the rendezvous; (node, returncode, output) each."""
    port = free_port_range(1)
    # as a user would start it: no interface forced (the tests' own loopback setting removed)
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    with nodes(2) as pair:
        first = pair[0]
        procs = [
            subprocess.Popen(
                node.command(
                    *(sys.executable, "-m", "meshscope", "run", "--config", str(TINY)),
                    *("--run-dir", str(tmp_path / f"node{i}"), "--run-id", "job", "--nproc", "2"),
                    *("--steps", str(steps), "--nnodes", "2", "--rdzv-endpoint", f"{first.address}:{port}"),
                    *("--metrics-port", "19400", *extra),
                ),
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for i, node in enumerate(pair)
        ]
        results = []
        for node, proc in zip(pair, procs):
            try:
                out, _ = proc.communicate(timeout=240)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
            results.append((node, proc.returncode, out))
        return results


def test_two_nodes_of_two_ranks_train_together_and_finish(tmp_path):
    results = agents(tmp_path)
    for node, code, out in results:
        assert code == 0, f"{node.name}: {out[-3000:]}"
    ranks = {}
    for i, (node, _, out) in enumerate(results):
        run = tmp_path / f"node{i}" / "job"
        steps = load_steps(run)
        ranks[i] = sorted(steps["rank"].unique().tolist())
        assert steps.groupby("rank")["step"].max().eq(11).all(), steps
        assert (steps["world_size"] == 4).all()
        # the node's metrics are announced on the address the cluster reaches, not loopback
        targets = json.loads((run / "targets.json").read_text())
        assert all(t.startswith(node.address + ":") for group in targets for t in group["targets"]), targets
        assert "12/12" in out, out[-1500:]  # this node's progress, though its ranks are not 0
    assert ranks == {0: [0, 1], 1: [2, 3]}, ranks
    assert load_events(tmp_path / "node0" / "job", kind="run_end").shape[0] == 1
