"""The advisor checked against measurement, and its search time.

Part 1 (search): `advise()` over every uniform layout of the 128-expert model
(`advisor/examples/moe-128e.toml`) on 1,024 devices (128 nodes x 8: the Ascend 910B and the
H100 cluster files), median of 5 timed searches after one warm one (target <= 1 s).

Part 2 (predicted vs measured): layouts of the reference MoE trained on this machine's CPU
ranks (gloo, a rank per core, both cores: `advisor/examples/cpu-local.toml`), each a
`meshscope run` of `--steps` steps. The model is calibrated on the `cal` runs only (data
parallel, expert parallel, and expert parallel with dropless dispatch, two batch sizes each),
then predicts the `held` runs, which it never saw: other batches of each. Printed side by side
with the error; targets median |error| <= 5 %, worst <= 10 % over the held-out runs. `--nodes`
does the same across two emulated nodes of one rank each (network namespaces, the link limited
to 1 Gbit/s), a cluster of its own. `--repeats N` records each local layout N times in
interleaved passes and keeps the least disturbed run of each (this shared VM moves one run's
step time by up to ±17 % between recordings).

    .venv/bin/python benchmarks/advisor.py [--steps N] [--repeats N] [--search-only] [--nodes] [--keep DIR]
    .venv/bin/python benchmarks/advisor.py --ceiling DIR DIR ...   (several kept run sets)

`--ceiling` scores the machine, not the model: each set's held-out runs predicted from the
same layouts in the other sets, scaled to the set's speed.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, machine, run_on_two_nodes

# name: (ranks, ep, batch per rank, role, extra settings)
LAYOUTS = {
    "dp2-b8": (2, 1, 8, "cal", ()),
    "dp2-b32": (2, 1, 32, "cal", ()),
    "dp2-ep2-b8": (2, 2, 8, "cal", ()),
    "dp2-ep2-b32": (2, 2, 32, "cal", ()),
    "dp2-b16": (2, 1, 16, "held", ()),
    "dp2-b24": (2, 1, 24, "held", ()),
    "dp2-b48": (2, 1, 48, "held", ()),
    "dp2-ep2-b16": (2, 2, 16, "held", ()),
    "dp2-ep2-b24": (2, 2, 24, "held", ()),
    "dp2-ep2-b48": (2, 2, 48, "held", ()),
    "dp2-ep2-b8-dropless": (2, 2, 8, "cal", ("parallel.dispatch=dropless",)),
    "dp2-ep2-b32-dropless": (2, 2, 32, "cal", ("parallel.dispatch=dropless",)),
    "dp2-ep2-b16-dropless": (2, 2, 16, "held", ("parallel.dispatch=dropless",)),
    "dp2-ep2-b24-dropless": (2, 2, 24, "held", ("parallel.dispatch=dropless",)),
}


def search_time() -> None:
    """Part 1: seconds per full search at 1,024 devices."""
    from meshscope.advisor.advise import advise
    from meshscope.advisor.specs import AdvisorConfig, load_cluster, load_model

    model = load_model("moe-128e")
    print(
        "| cluster | devices | layouts evaluated | search s (median of 5) | best layout | predicted step s |"
    )
    print("|---|---|---|---|---|---|")
    for name in ("ascend-910b", "h100"):
        cluster = load_cluster(name)
        advise(model, cluster, AdvisorConfig())
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            advice = advise(model, cluster, AdvisorConfig())
            times.append(time.perf_counter() - t0)
        best = advice.best()
        print(
            f"| {cluster.name} | {cluster.devices} | {advice.evaluated:,} | {statistics.median(times):.3f} "
            f"| {best.label} | {best.step_s:.2f} |"
        )


def train(root: Path, name: str, ranks: int, ep: int, batch: int, extra: tuple[str, ...], steps: int) -> Path:
    """One `meshscope run` of a layout on this machine; its run directory."""
    cmd = [sys.executable, "-m", "meshscope", "run", "--config", str(REPO / "configs/demo.toml")]
    cmd += ["--run-dir", str(root), "--run-id", name, "--nproc", str(ranks), "--steps", str(steps)]
    cmd += [
        "--metrics-port",
        "9890",
        "--set",
        'train.compression="none"',
        "--set",
        f"train.batch_size={batch}",
    ]
    cmd += ["--set", f"parallel.ep={ep}", "--set", "train.overlap=true"]
    for setting in extra:
        cmd += ["--set", setting]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    return root / name


def recorded(root: Path, steps: int, repeats: int) -> dict[str, Path]:
    """Each layout's run, recorded `repeats` times in interleaved passes (kept ones reused): the
    least disturbed one (lowest median step) stands for it, in calibration and as the truth
    alike. One run's median drifts by ±10-17 % between recordings on this shared VM at small
    batches, as much as the target allows the prediction to miss."""
    from meshscope.advisor.calibrate import measure

    passes = []
    for r in range(repeats):
        passes.append({})
        for name, spec in LAYOUTS.items():
            run_id = name if r == 0 else f"{name}-r{r}"
            done = (root / run_id / "store.sqlite").exists()
            passes[r][name] = root / run_id if done else train(root, run_id, *spec[:3], spec[4], steps)
    if repeats == 1:  # nothing to choose between: compare() measures each run once
        return passes[0]
    return {name: min((p[name] for p in passes), key=lambda path: measure(path).step_s) for name in LAYOUTS}


def predicted_vs_measured(steps: int, keep: Path | None, with_nodes: bool, repeats: int = 1) -> None:
    """Part 2 (see the module doc)."""
    from meshscope.advisor.specs import load_cluster

    with tempfile.TemporaryDirectory() as tmp:
        root = keep or Path(tmp)
        runs = recorded(root, steps, repeats)
        compare(load_cluster("cpu-local"), {name: (runs[name], spec[3]) for name, spec in LAYOUTS.items()})
        if with_nodes:
            cluster = emulated_cluster()
            node_runs = {
                name: (run_on_two_nodes(root, name, LINK, steps, *node_settings(batch))[0], role)
                for name, (batch, role) in NODE_LAYOUTS.items()
            }
            print(f"\n{cluster.name}:\n")
            compare(cluster, node_runs)


def compare(cluster, runs: dict[str, tuple[Path, str]]) -> None:
    """Calibrate on the `cal` runs, predict every run, print both, then the parts."""
    from meshscope.advisor.calibrate import calibrate, measure, predict_run

    fitted = calibrate([path for path, role in runs.values() if role == "cal"], cluster)
    assert not fitted.skipped, fitted.skipped
    print("| run | role | layout | measured step ms | predicted ms (interval) | error |")
    print("|---|---|---|---|---|---|")
    held, parts = [], []
    for name, (path, role) in runs.items():
        run = measure(path)
        p = predict_run(run, cluster, fitted.factors)
        err = p.step_s / run.step_s - 1
        if role == "held":
            held.append((abs(err), p.step_lo_s <= run.step_s <= p.step_hi_s))
        interval = f"{p.step_s * 1e3:.1f} ({p.step_lo_s * 1e3:.1f}–{p.step_hi_s * 1e3:.1f})"
        print(
            f"| {name} | {role} | {run.layout.label()} | {run.step_s * 1e3:.1f} | {interval} | {err:+.1%} |"
        )
        # the per-step overhead is the compute line's intercept, so measured it is compute; what
        # expert parallelism adds to it was measured in the optimizer phase
        fixed = fitted.factors.step_overhead_s
        pairs = [(run.compute_s, p.compute_s + fixed), (run.optimizer_s, p.other_s - fixed)]
        pairs += [(run.grad_exposed_s, p.comm_exposed_s), (run.a2a_s, p.a2a_s)]
        parts.append(f"  {name}: " + "  ".join(f"{m * 1e3:.1f}/{q * 1e3:.1f}" for m, q in pairs))
    errors = sorted(e for e, _ in held)
    print(
        f"\nheld-out: median |error| {statistics.median(errors):.1%}, worst {errors[-1]:.1%}, "
        f"inside the interval {sum(i for _, i in held)}/{len(held)}"
    )
    print(
        "\nparts, measured/predicted ms: compute (with the per-step overhead), "
        "optimizer (with expert parallelism's), "
        "exposed gradient sync, all-to-all"
    )
    print("\n".join(parts))
    print("factors:", {k: round(getattr(fitted.factors, k), 4) for k in fitted.factors.names()})
    for name, why in fitted.factors.rejected.items():
        print(f"not used: {name}: {why}")
    for name, what in fitted.factors.assumed.items():
        print(f"assumed: {name}: {what}")
    print("fitted from measurement:", sorted(fitted.factors.measured))
    for note in fitted.notes:
        print("note:", note)


def noise_ceiling(sets: list[Path], steps: int) -> None:
    """`--ceiling`: the held-out error of a predictor that knows each layout's step time from
    the other recorded sets, scaled to this set's speed (the mean ratio over its calibration
    runs). No model of this machine can expect to do better: what it misses is how one
    recording differs from another, the machine's own repeatability."""
    times = []
    for root in sets:
        repeats = 1 + max((int(p.name.rsplit("-r", 1)[1]) for p in root.glob("*-r[0-9]*")), default=0)
        times.append({name: measure_step_s(path) for name, path in recorded(root, steps, repeats).items()})
    held = [n for n, spec in LAYOUTS.items() if spec[3] == "held"]
    cal = [n for n, spec in LAYOUTS.items() if spec[3] == "cal"]
    print("| run set | speed (cal runs against the others) | held-out median | worst |")
    print("|---|---|---|---|")
    for i, root in enumerate(sets):
        others = {n: statistics.mean(t[n] for j, t in enumerate(times) if j != i) for n in LAYOUTS}
        speed = statistics.mean(times[i][n] / others[n] for n in cal)
        errors = {n: speed * others[n] / times[i][n] - 1 for n in held}
        worst = max(errors, key=lambda n: abs(errors[n]))
        median = statistics.median(abs(e) for e in errors.values())
        print(f"| {root} | {speed:.2f} | {median:.1%} | {errors[worst]:+.1%} ({worst}) |")


def measure_step_s(path: Path) -> float:
    from meshscope.advisor.calibrate import measure

    return measure(path).step_s


# Across two emulated nodes, one rank each, the link limited to LINK: name -> (batch, role)
LINK = "1gbit"
NODE_LAYOUTS = {
    "nodes-b8": (8, "cal"),
    "nodes-b32": (32, "cal"),
    "nodes-b16": (16, "held"),
    "nodes-b24": (24, "held"),
}


def node_settings(batch: int) -> tuple[str, ...]:
    """What every emulated-node run sets."""
    return ('train.compression="none"', f"train.batch_size={batch}")


def emulated_cluster():
    """Two namespaces of one CPU rank each, joined by a LINK veth (the CPU cluster's device)."""
    from meshscope.advisor.specs import ClusterSpec, load_cluster

    cpu = load_cluster("cpu-local")
    inter = {"name": f"veth, tc {LINK}", "bandwidth_gbs": 0.125, "latency_us": 50}
    return ClusterSpec(
        name=f"2 emulated nodes x 1 rank ({LINK})", backend="gloo", nodes=2, devices_per_node=1,
        device=cpu.device, intra=cpu.intra, inter=inter,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--search-only", action="store_true")
    parser.add_argument("--keep", type=Path, help="keep the runs here (and reuse those already there)")
    parser.add_argument("--nodes", action="store_true", help="also layouts across two emulated nodes (root)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="record each local layout N times; the least disturbed run counts",
    )
    parser.add_argument(
        "--ceiling",
        type=Path,
        nargs="+",
        metavar="DIR",
        help="kept run sets (each a --keep DIR): the error of a predictor that knows every layout from "
        "the other sets, this machine's own limit; nothing else runs",
    )
    args = parser.parse_args()
    if args.ceiling and len(args.ceiling) < 2:
        parser.error("--ceiling: give two recorded sets or more (each is predicted from the others)")
    print(f"machine: {machine()}\n")
    if args.ceiling:
        noise_ceiling(args.ceiling, args.steps)
        return
    search_time()
    if not args.search_only:
        print()
        predicted_vs_measured(args.steps, args.keep, args.nodes, args.repeats)


if __name__ == "__main__":
    main()
