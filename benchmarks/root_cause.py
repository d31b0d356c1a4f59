"""How often `meshscope explain` ranks the injected cause first, over recorded runs of every
injection kind.

Runs: the detection-quality recordings (slow, comm_delay, nan, expert_collapse, memory_leak,
hang; two of each at different steps, ranks and strengths) plus runs recorded here for the
kinds that end a step for good: kill (torchrun restarts from a checkpoint), a rank that kills
itself after every restart (recovery that keeps failing), a skipped collective and a mismatched
collective (the hang watchdog aborts and the run resumes). The `injected` events are the ground
truth; explain sees only the steps, expert loads and the other events.

    .venv/bin/python benchmarks/root_cause.py [--record [RUN...]]
"""

from __future__ import annotations

import argparse
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, machine

from fixtures import recorded

DATA = recorded.STORES
EXPECTED, RECORDED_HERE, FLAGS = recorded.CAUSES, recorded.ROOT_CAUSE, recorded.ROOT_CAUSE_FLAGS
runs, injection_kind = recorded.injected_runs, recorded.injection_kind


def judge(run: Path) -> dict:
    """Explain one run; was the injected cause ranked first (and on the right rank)?"""
    kind, rank = injection_kind(run)
    want, rank_known = EXPECTED[kind]
    from meshscope.explain.ranking import explain

    t0 = time.perf_counter()
    causes = explain(run)
    took = time.perf_counter() - t0
    top = causes[0] if causes else None
    ok = top is not None and top.kind == want and (not rank_known or top.ranks == [rank])
    return {
        "run": run.name,
        "kind": kind,
        "want": want,
        "top": top.kind if top else "-",
        "ranks": top.ranks if top else [],
        "confidence": top.confidence if top else 0.0,
        "ok": ok,
        "seconds": took,
        "causes": causes,
    }


def record(only: list[str] | None = None) -> None:
    """Record the runs this benchmark adds (the others come from detection_quality.py)."""
    config = Path(tempfile.mkdtemp()) / "bench.toml"
    config.write_text((REPO / "fixtures/tiny.toml").read_text())
    for name, injections in RECORDED_HERE.items():
        if only and name not in only:
            continue
        root = Path(tempfile.mkdtemp())
        cmd = [
            sys.executable,
            "-m",
            "meshscope",
            "run",
            "--config",
            str(config),
            "--run-dir",
            str(root),
            "--run-id",
            name,
            "--steps",
            "50",
            "--checkpoint-every",
            "5",
            *FLAGS[name],
        ]
        for spec in injections:
            cmd += ["--inject", spec]
        subprocess.run(cmd, cwd=REPO, capture_output=True, timeout=600)  # kill_loop fails
        (DATA / name).mkdir(parents=True, exist_ok=True)
        src = sqlite3.connect(root / name / "store.sqlite")
        dst = sqlite3.connect(DATA / name / "store.sqlite")
        src.backup(dst)
        dst.execute("DELETE FROM events WHERE kind = 'anomaly'")  # explain judges afresh
        dst.commit()
        dst.execute("PRAGMA journal_mode=DELETE")
        src.close()
        dst.close()
        print(f"recorded {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--record", nargs="*", default=None, metavar="RUN")
    args = parser.parse_args()
    if args.record is not None:
        record(args.record or None)
        return
    rows = [judge(run) for run in runs()]
    print(f"# root cause ranking, {machine()}")
    print("| run | injected | expected first | ranked first | ranks | confidence | ok |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['run']} | {r['kind']} | {r['want']} | {r['top']} | {r['ranks']} | "
            f"{r['confidence']:.2f} | {'yes' if r['ok'] else 'NO'} |"
        )
    hits = sum(r["ok"] for r in rows)
    print(
        f"\ninjected cause ranked first: {hits}/{len(rows)} = {hits / len(rows):.1%}; "
        f"explain took {max(r['seconds'] for r in rows):.2f} s at most per run"
    )


if __name__ == "__main__":
    main()
