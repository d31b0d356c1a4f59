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

from fixtures import recorded

DATA = recorded.EXPERTS
SHAPES, FAULTS, run_names = recorded.EXPERT_SHAPES, recorded.EXPERT_FAULTS, recorded.expert_runs
START, STEPS, FAULT_STEPS, CLEAN_STEPS = 50, 90, 20, 400
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


judge, score = recorded.expert_episodes, recorded.expert_scores


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
