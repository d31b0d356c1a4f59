"""Scaling efficiency and the Training Efficiency Index, measured.

The same model and per-rank batch (`configs/demo.toml` shapes, no compression, `--steps`
steps) on 1, 2 and 4 CPU ranks of this machine, and on 2 emulated nodes of one rank each
(network namespaces on a bridge, the link limited to `--link`). Scaling efficiency is the
job's tokens/s over the one-rank run's times the ranks (weak scaling); TEI = scaling
efficiency x (1 - exposed communication / step time) x productive / wall time, as the run
summary computes it (`collector/figures.py`). 4 ranks on 2 cores share cores: its figure
says what oversubscription costs, not what the code scales to.

    .venv/bin/python benchmarks/scaling.py [--steps N] [--link 1gbit] [--keep DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import REPO, machine, run_on_two_nodes

SETTINGS = ('train.compression="none"', "train.batch_size=16")


def local(root: Path, name: str, ranks: int, steps: int) -> list[Path]:
    """A run of `ranks` ranks on this machine; its run directory (in a list, like `nodes`)."""
    if not (root / name / "store.sqlite").exists():
        cmd = [sys.executable, "-m", "meshscope", "run", "--config", str(REPO / "configs/demo.toml")]
        cmd += ["--run-dir", str(root), "--run-id", name, "--nproc", str(ranks), "--steps", str(steps)]
        for setting in SETTINGS:
            cmd += ["--set", setting]
        subprocess.run([*cmd, "--metrics-port", "9930"], cwd=REPO, check=True, capture_output=True)
    return [root / name]


def figures(dirs: list[Path], one_rank_tokens_per_s: float) -> dict[str, float]:
    """TEI and its parts over every node's steps."""
    import pandas as pd

    from meshscope.collector.figures import tokens_per_second, training_efficiency_index
    from meshscope.collector.store import load_retried_steps, load_steps

    steps = pd.concat([load_steps(d) for d in dirs], ignore_index=True)
    retried = pd.concat([load_retried_steps(d) for d in dirs], ignore_index=True)
    out = training_efficiency_index(steps, one_rank_tokens_per_s, retried)
    return {**out, "tokens_per_s": tokens_per_second(steps), "ranks": steps["rank"].nunique()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--link", default="1gbit")
    parser.add_argument("--keep", type=Path)
    args = parser.parse_args()
    print(f"machine: {machine()}\n")
    from meshscope.collector.figures import tokens_per_second
    from meshscope.collector.store import load_steps

    with tempfile.TemporaryDirectory() as tmp, contextlib.suppress(KeyboardInterrupt):
        root = args.keep or Path(tmp)
        layouts = {f"{r} rank{'s' * (r > 1)}": local(root, f"ranks{r}", r, args.steps) for r in (1, 2, 4)}
        layouts[f"2 nodes x 1 rank ({args.link})"] = run_on_two_nodes(
            root, "nodes", args.link, args.steps, *SETTINGS
        )
        one = tokens_per_second(load_steps(layouts["1 rank"][0]))
        print("| layout | ranks | tokens/s | scaling efficiency | comm overhead | fault tolerance | TEI |")
        print("|---|---|---|---|---|---|---|")
        for name, dirs in layouts.items():
            f = figures(dirs, one)
            print(
                f"| {name} | {f['ranks']} | {f['tokens_per_s']:,.0f} | {f['scaling_efficiency']:.1%} "
                f"| {f['comm_overhead']:.1%} | {f['fault_tolerance']:.1%} | {f['tei']:.1%} |"
            )


if __name__ == "__main__":
    main()
