"""Memory: what the Monitor (+ exporter + store) adds to a rank, and what the detection engine
holds for a large job.

1. Per rank: the same single-process MoE loop in two fresh processes, plain and watched by a
   Monitor with its /metrics exporter and run store (records, expert load, events). Reported:
   peak RSS of each (`ru_maxrss`) and the difference. Target: <= 50 MB.
2. The engine: 1,024 ranks x 10,000 steps fed as the live path feeds it (the rows of the steps
   written since the last poll, 50 steps at a time), in a fresh process; peak RSS, and how it
   grows from step 2,000 to 10,000 (the engine keeps windows, not history). Target: <= 1 GB.

    .venv/bin/python benchmarks/memory.py [--steps 300] [--ranks 1024 --engine-steps 10000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from _common import REPO, machine

CHILD = r"""
import json, resource, sys, tempfile, time
import torch
sys.path.insert(0, {repo!r})
from meshscope.trainer.config import ModelConfig
from meshscope.trainer.model import MoELM

watched, steps = {watched}, {steps}
torch.manual_seed(0)
torch.set_num_threads(1)
model = MoELM(ModelConfig(vocab_size=128, seq_len=32, layers=2, d_model=64, heads=4, experts=8,
                          top_k=2))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
mon = None
if watched:
    from prometheus_client import CollectorRegistry
    from meshscope.collector import Monitor, MonitorConfig
    from fixtures.ports import free_port_range
    mon = Monitor(MonitorConfig(run_dir=__import__("pathlib").Path(tempfile.mkdtemp()) / "run",
                                run_id="mem", metrics_port=free_port_range(1)),
                  registry=CollectorRegistry())
    model = mon.watch(model)
x = torch.randint(0, 128, (8, 32))
for step in range(steps):
    if mon is not None:
        with mon.step(tokens=256) as s:
            loss, _ = model.loss(model(x), x)
            loss.backward()
            opt.step(); opt.zero_grad()
            s.log(loss=loss)
    else:
        loss, _ = model.loss(model(x), x)
        loss.backward()
        opt.step(); opt.zero_grad()
if mon is not None:
    mon.close()
print(json.dumps({{"maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""

ENGINE = r"""
import json, resource, sys, time
import numpy as np, pandas as pd
sys.path.insert(0, {repo!r})
from meshscope.detectors.engine import DetectionEngine

ranks, steps, chunk = {ranks}, {steps}, 50
rng = np.random.default_rng(0)
engine = DetectionEngine()
marks = {{}}
t0 = time.perf_counter()
for start in range(0, steps, chunk):
    n = min(chunk, steps - start)
    c = 0.1 * (1 + 0.03 * rng.standard_normal((n, ranks)))
    step_s = np.repeat(c.max(axis=1, keepdims=True), ranks, axis=1)
    frame = pd.DataFrame({{
        "rank": np.tile(np.arange(ranks), n), "world_size": ranks,
        "step": np.repeat(np.arange(start, start + n), ranks),
        "step_s": step_s.ravel(), "data_s": 0.0, "comm_exposed_s": (step_s - c).ravel(),
        "comm_ratio": ((step_s - c) / step_s).ravel(), "bytes_wire": 1000.0, "loss": 3.0,
        "grad_norm": 1.0, "tokens": 256.0, "mem_rss": 1e9, "nonfinite": ""}})
    engine.process(frame)
    done = start + n
    if done in (2000, steps):
        marks[done] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
engine.finish()
print(json.dumps({{"maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                   "marks": marks, "seconds": time.perf_counter() - t0}}))
"""


def child(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--engine-steps", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(f"# memory, {machine()}")
    deltas = []
    for i in range(args.repeats):
        plain = child(CHILD.format(repo=str(REPO), watched=False, steps=args.steps))
        watched = child(CHILD.format(repo=str(REPO), watched=True, steps=args.steps))
        deltas.append(watched["maxrss_mb"] - plain["maxrss_mb"])
        print(
            f"rank, try {i + 1}: plain {plain['maxrss_mb']:.0f} MB, with Monitor + exporter + "
            f"store {watched['maxrss_mb']:.0f} MB: +{deltas[-1]:.1f} MB ({args.steps} steps)"
        )
    print(f"Monitor adds {max(deltas):.1f} MB at most (target <= 50 MB)")
    t0 = time.time()
    eng = child(ENGINE.format(repo=str(REPO), ranks=args.ranks, steps=args.engine_steps))
    marks = {int(k): v for k, v in eng["marks"].items()}
    print(
        f"engine, {args.ranks} ranks x {args.engine_steps} steps: peak RSS "
        f"{eng['maxrss_mb']:.0f} MB (target <= 1024 MB); at step 2,000 "
        f"{marks.get(2000, float('nan')):.0f} MB, at the end {marks.get(args.engine_steps, 0):.0f}"
        f" MB; {eng['seconds']:.0f} s ({time.time() - t0:.0f} s with start-up)"
    )


if __name__ == "__main__":
    main()
