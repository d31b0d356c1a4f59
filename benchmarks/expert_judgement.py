"""Expert-load judgement over recorded runs at several (experts, top-k): collapses, hogs and
starvation found, how fast, and nothing raised on long clean runs.

Recorded once with `--record` (2 CPU ranks, 2 MoE layers, expert load summed every 2 steps):
per (E, k) a collapse (every token's first choice on one expert), a hog (a few logits of
preference), a starvation (one expert never chosen), each for 20 steps on a varying layer and
expert, and one long clean run. Scoring replays the stores through the detection engine as
`meshscope run` uses it; the run's top-k is read from its config.json, and once more inferred
from the counts alone (a user's own loop has no config).

Per run kind: recall, precision, F1 and the delay from the injection to the first alarm (in
steps; a window of `expert_every` steps cannot be judged before it closes), and false alarms in
the clean runs.

    .venv/bin/python benchmarks/expert_judgement.py [--record]
"""

from __future__ import annotations

import argparse
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import REPO, machine

from meshscope.collector.rundir import run_info
from meshscope.collector.store import load_events, load_expert_load, load_steps
from meshscope.detectors.engine import DetectionEngine
from meshscope.detectors.episodes import Episode

DATA = REPO / "benchmarks" / "data" / "experts"
SHAPES = [(4, 1), (4, 2), (8, 2), (16, 4)]
START, STEPS, FAULT_STEPS, CLEAN_STEPS = 50, 90, 20, 400
FAULTS = {"collapse": 20.0, "hog": 2.5, "starve": -30.0}
CONFIG = """nproc = 2
device = "cpu"
expert_every = 2

[model]
vocab_size = 64
seq_len = 16
layers = 2
d_model = 32
heads = 2
experts = {experts}
top_k = {top_k}

[train]
steps = {steps}
batch_size = 8
lr = 1e-2
"""


def run_names() -> list[tuple[str, int, int, str]]:
    """(name, experts, top_k, fault or 'clean') of every recorded run."""
    out = []
    for experts, top_k in SHAPES:
        for fault in (*FAULTS, "clean"):
            out.append((f"e{experts}k{top_k}-{fault}", experts, top_k, fault))
    return out


def record() -> None:
    """Record every run (a few minutes on 2 cores)."""
    tmp = Path(tempfile.mkdtemp())
    for i, (name, experts, top_k, fault) in enumerate(run_names()):
        steps = CLEAN_STEPS if fault == "clean" else STEPS
        config = tmp / f"{name}.toml"
        config.write_text(CONFIG.format(experts=experts, top_k=top_k, steps=steps))
        cmd = [
            sys.executable,
            "-m",
            "meshscope",
            "run",
            "--config",
            str(config),
            "--run-dir",
            str(tmp),
            "--run-id",
            name,
            "--metrics-port",
            "9860",
        ]
        if fault != "clean":
            layer, expert = i % 2, (i * 3) % experts
            cmd += [
                "--inject",
                f"expert_collapse@step={START},rank=0,steps={FAULT_STEPS},"
                f"layer={layer},expert={expert},logit={FAULTS[fault]}",
            ]
        subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, timeout=900)
        dst_dir = DATA / name
        dst_dir.mkdir(parents=True, exist_ok=True)
        src = sqlite3.connect(tmp / name / "store.sqlite")
        dst = sqlite3.connect(dst_dir / "store.sqlite")
        src.backup(dst)
        dst.execute("DELETE FROM events WHERE kind = 'anomaly'")
        dst.commit()
        dst.execute("PRAGMA journal_mode=DELETE")
        dst.execute("VACUUM")
        src.close()
        dst.close()
        shutil.copy(tmp / name / "config.json", dst_dir / "config.json")
        print(f"recorded {name}")


def judge(run: Path, *, use_config: bool = True) -> list[Episode]:
    """The expert_imbalance episodes the engine raises on a recorded run."""
    found: list[Episode] = []
    engine = DetectionEngine(top_k=run_info(run).top_k if use_config else None, on_close=found.append)
    engine.process(load_steps(run), load_expert_load(run))
    engine.finish()
    return [e for e in found if e.type == "expert_imbalance"]


def score(use_config: bool = True) -> dict[str, dict]:
    """Per fault kind: tp, fn, fp, delays; and false alarms on clean runs."""
    table: dict[str, dict] = {k: {"tp": 0, "fn": 0, "fp": 0, "delays": []} for k in (*FAULTS, "clean")}
    for name, _, _, fault in run_names():
        run = DATA / name
        episodes = judge(run, use_config=use_config)
        row = table[fault]
        if fault == "clean":
            row["fp"] += len(episodes)
            row["steps"] = row.get("steps", 0) + int(load_steps(run)["step"].max()) + 1
            continue
        inj = load_events(run, kind="injected")["detail"].iloc[0]
        layer, lo = int(inj["params"]["layer"]), int(inj["start_step"])
        hi = lo + int(inj["steps"]) + 6  # the window after the fault still holds its tokens
        hits = [e for e in episodes if e.layer == layer and e.start_step <= hi and e.end_step >= lo]
        row["fp"] += len([e for e in episodes if e not in hits])
        if hits:
            row["tp"] += 1
            row["delays"].append(max(0, min(e.start_step for e in hits) - lo))
        else:
            row["fn"] += 1
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    if args.record:
        record()
        return
    print(f"# expert judgement over recorded runs, (E, k) in {SHAPES}, {machine()}")
    for use_config, label in (
        (True, "top-k from the run's config"),
        (False, "top-k inferred from the counts"),
    ):
        table = score(use_config)
        print(f"\n## {label}\n")
        print("| runs | found | missed | false alarms | F1 | delay max (steps) |")
        print("|---|---|---|---|---|---|")
        tp = fn = fp = 0
        for kind, r in table.items():
            if kind == "clean":
                continue
            tp, fn, fp = tp + r["tp"], fn + r["fn"], fp + r["fp"]
            f1 = 2 * r["tp"] / max(2 * r["tp"] + r["fn"] + r["fp"], 1)
            print(
                f"| {kind} | {r['tp']} | {r['fn']} | {r['fp']} | {f1:.2f} | {max(r['delays'], default='-')} |"
            )
        clean = table["clean"]
        fp += clean["fp"]
        f1 = 2 * tp / max(2 * tp + fn + fp, 1)
        print(f"| clean ({clean['steps']} steps) | - | - | {clean['fp']} | - | - |")
        print(f"\nall: F1 {f1:.3f} (target >= 0.95), false alarms on clean runs {clean['fp']} (target 0)")


if __name__ == "__main__":
    main()
