"""The causal chain under expert parallelism: does `meshscope explain` tell a rank slowed by the
experts placed on it from a rank slowed by its host?

4 CPU ranks, experts sharded one per rank (`parallel.ep=4`, dropless dispatch, so an expert
computes exactly the tokens it gets), 90 steps of a wider model than tests use. Scenarios, each
from step 40 for 40 steps, onset rank varied over repeats:

- `hot`: every rank's router prefers expert e (held by rank e): that rank's experts process
  about twice the mean tokens; expected first: `hot_experts` on rank e (its slow host, if named,
  ranked below: the load explains it).
- `slow`: rank r computes 2x slower with balanced routing: expected first `slow_host` on rank r,
  and no `hot_experts` (the load is even).

A hit is the expected cause ranked first among the causes that name a slow rank or its load
(hot_experts, slow_host, host_oversubscribed, routing); other findings (a memory reading, a
checkpoint) are listed, not scored.

`--replace`: live re-placement against its untreated twin instead. 2 ranks, ep=2, dropless,
a router that prefers expert 0 (`model.router_skew=2`), 240 steps, the same seed; the treated
run re-places when a rank's experts carry 1.15x the mean (cooldown 30 steps). Compared over
the steps after the first move: the max/mean of per-rank tokens (the load the placement
evens) and the median step time, treated / untreated, per repeat.

`--node-loss`: a node of an expert-parallel job dies for good. 2 agents ("nodes") of 2 ranks,
ep=2 (each node holds every expert once: EP groups stay inside a node), checkpoints every 5
steps; once both nodes have trained 15 steps together, one node's whole process tree is
killed. The survivor restarts alone (2 ranks, still ep=2) and restores every expert from the
sharded checkpoint; reported: the resume, steps lost, the time from the loss to the restored
state and to the first step after it, and that the final checkpoint holds every expert.

    .venv/bin/python benchmarks/expert_parallel.py [--repeats N] [--replace] [--node-loss]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import REPO, machine

SCENARIOS = {
    "hot": ("hot_experts", "expert_collapse@step=40,rank={r},steps=40,layer=1,expert={e},logit=20"),
    "slow": ("slow_host", "slow@step=40,rank={e},steps=40,factor=2"),
}
SCORED = {"hot_experts", "slow_host", "host_oversubscribed", "routing"}
RANKS, STEPS = 4, 90


def run(root: Path, name: str, injections: list[str]) -> Path:
    """One `meshscope run` of the scenario; its run directory."""
    cmd = [sys.executable, "-m", "meshscope", "run", "--config", str(REPO / "fixtures/tiny.toml")]
    cmd += ["--run-dir", str(root), "--run-id", name, "--nproc", str(RANKS), "--steps", str(STEPS)]
    cmd += ["--metrics-port", "9870", "--set", f"parallel.ep={RANKS}", "--set", "parallel.dispatch=dropless"]
    cmd += ["--set", "model.d_model=128", "--set", "model.ffn_mult=8"]
    for spec in injections:
        cmd += ["--inject", spec]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    return root / name


def _after(run: Path, first: int) -> tuple[float, float]:
    """Median max/mean of per-rank expert tokens, and median step time, after step `first`."""
    import numpy as np

    from meshscope.collector.store import load_expert_work, load_steps

    work = load_expert_work(run)
    work = work[work["step"] > first + 5].pivot_table(
        index=["step", "layer"], columns="rank", values="tokens"
    )
    steps = load_steps(run)
    skew = float(np.median(work.max(axis=1) / work.mean(axis=1)))
    return skew, float(steps[steps["step"] > first]["step_s"].median())


def replace(repeats: int) -> None:
    """Treated (live re-placement) against untreated twins (see the module doc)."""
    from meshscope.collector.controls import load_controls

    flags = [
        "--nproc",
        "2",
        "--steps",
        "240",
        "--set",
        "parallel.ep=2",
        "--set",
        "parallel.dispatch=dropless",
    ]
    flags += ["--set", "model.router_skew=2", "--set", "model.d_model=128", "--set", "model.ffn_mult=8"]
    treat = ["--set", "parallel.replace_threshold=1.15", "--set", "parallel.replace_cooldown=30"]
    print(f"# live expert re-placement against its untreated twin, {machine()}")
    print("| repeat | first move at | moves | max/mean rank tokens untreated → treated | step time t / u |")
    print("|---|---|---|---|---|")
    for i in range(repeats):
        runs = {}
        for name, extra in (("untreated", []), ("treated", treat)):
            root = Path(tempfile.mkdtemp())
            cmd = [sys.executable, "-m", "meshscope", "run", "--config", str(REPO / "fixtures/tiny.toml")]
            cmd += ["--run-dir", str(root), "--run-id", name, "--metrics-port", "9870", *flags, *extra]
            subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
            runs[name] = root / name
        moves = load_controls(runs["treated"])
        moves = moves[(moves["kind"] == "expert_placement") & (moves["status"] == "applied")]
        if moves.empty:
            print(f"| {i} | - | 0 | - | - |")
            continue
        first = int(moves["step"].min())

        (skew_u, time_u), (skew_t, time_t) = _after(runs["untreated"], first), _after(runs["treated"], first)
        print(f"| {i} | {first} | {len(moves)} | {skew_u:.3f} → {skew_t:.3f} | {time_t / time_u:.3f} |")


def node_loss(repeats: int) -> None:
    """A node of an expert-parallel job killed for good (see the module doc)."""
    import os
    import signal
    import time

    import torch
    import torch.distributed.checkpoint as dcp

    from fixtures.ports import free_port_range
    from meshscope.collector.store import load_events, load_steps
    from meshscope.config import load_config
    from meshscope.trainer.model import MoELM

    print(f"# a node of an expert-parallel job lost for good, {machine()}")
    header = "| repeat | world then → now | resumed from | steps lost | loss → restored | loss → first step |"
    print(header + " every expert in the final checkpoint |")
    print("|---|---|---|---|---|---|---|")
    for i in range(repeats):
        root = Path(tempfile.mkdtemp())
        rdzv = free_port_range(1)
        store = subprocess.Popen(
            [sys.executable, "-m", "meshscope", "rendezvous", "--port", str(rdzv)],
            cwd=REPO,
            stdout=subprocess.PIPE,
        )
        store.stdout.readline()
        flags = ["--config", str(REPO / "fixtures/tiny.toml"), "--run-dir", str(root), "--run-id", "ep"]
        flags += ["--nproc", "2", "--steps", "200", "--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{rdzv}"]
        flags += [
            "--rdzv-external",
            "--max-restarts",
            "3",
            "--checkpoint-every",
            "5",
            "--set",
            "parallel.ep=2",
        ]
        # the rendezvous' last call (elastic.last_call_s, 3 s) stays the default: a re-rendezvous
        # after the loss waits it out, and it is part of what recovery costs
        ports = free_port_range(20)  # two agents on one host: a metrics base of their own each
        agents = [
            subprocess.Popen(
                [sys.executable, "-m", "meshscope", "run", *flags, "--metrics-port", str(ports + 10 * a)],
                cwd=REPO,
                start_new_session=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for a in range(2)
        ]
        run = root / "ep"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                steps = load_steps(run)
            except Exception:  # noqa: BLE001  (not there yet)
                steps = None
            if steps is not None and len(steps) and steps[steps["world_size"] == 4]["step"].max() >= 15:
                break
            time.sleep(0.3)
        os.killpg(agents[1].pid, signal.SIGKILL)  # the whole node: agent and workers
        killed_at = time.time()
        agents[0].wait(timeout=600)
        store.kill()
        events = load_events(run)
        resume = events[events["kind"] == "resume"].iloc[-1]["detail"]
        steps = load_steps(run)
        first = steps[(steps["world_size"] == 2) & (steps["step"] > resume["from_step"])]["time"].min()
        cfg = load_config(REPO / "fixtures/tiny.toml")
        state = {"model": MoELM(cfg.model).state_dict()}
        newest = sorted((run / "checkpoints").glob("step_*"))[-1]
        dcp.load(state, checkpoint_id=str(newest))  # every expert of every layer, read whole
        whole = all(torch.isfinite(v).all() for k, v in state["model"].items() if ".experts." in k)
        print(
            f"| {i} | {resume['world_size_then']} → {resume['world_size_now']} | {resume['from_step']} "
            f"| {resume['steps_lost']} | {resume['restored_at'] - killed_at:.2f} s "
            f"| {first - killed_at:.2f} s | {'yes' if whole else 'NO'} ({newest.name}) |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--replace", action="store_true", help="live re-placement against its untreated twin")
    parser.add_argument("--node-loss", action="store_true", help="a node of an expert-parallel job dies")
    args = parser.parse_args()
    if args.node_loss:
        node_loss(args.repeats)
        return
    if args.replace:
        replace(args.repeats)
        return
    from meshscope.explain.ranking import explain

    print(f"# causal chain under expert parallelism, {machine()}; {RANKS} ranks, ep={RANKS}, dropless")
    print("| scenario | culprit | first scored cause | its ranks | confidence | hit | other causes |")
    print("|---|---|---|---|---|---|---|")
    hits = []
    for name, (want, spec) in SCENARIOS.items():
        for i in range(args.repeats):
            culprit = (3 - i) % RANKS
            # the skewed router acts on every rank's tokens; the slow rank is one rank
            ranks = range(RANKS) if name == "hot" else [culprit]
            injections = [spec.format(r=r, e=culprit) for r in ranks]
            causes = explain(run(Path(tempfile.mkdtemp()), f"{name}-{i}", injections))
            scored = [c for c in causes if c.kind in SCORED]
            top = scored[0] if scored else None
            hit = top is not None and top.kind == want and top.ranks == [culprit]
            if name == "slow":
                hit = hit and not any(c.kind == "hot_experts" for c in causes)
            hits.append(hit)
            others = ", ".join(f"{c.kind} {c.ranks} {c.confidence:.2f}" for c in causes if c is not top)
            first = f"{top.kind} | {top.ranks} | {top.confidence:.2f}" if top else "- | - | -"
            print(f"| {name} | {culprit} | {first} | {'yes' if hit else 'NO'} | {others or '-'} |")
    print(f"\nright cause first: {sum(hits)}/{len(hits)}")


if __name__ == "__main__":
    main()
