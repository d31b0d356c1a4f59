"""Where communication time goes: overlap vs all-reduce-after-backward, and what compression
saves in bytes and costs in loss.

Every mode is a real `trainer.worker` job under torchrun, measured by the Monitor's
StepRecords, all in one invocation:
  * overlap (bucketed DDP) vs --no-overlap (one bucket, so all-reduce starts after backward):
    exposed communication, the share of it overlap removes, and the overlap efficiency
    = hidden communication / min(communication, backward compute);
  * none / fp16 / powersgd / onebit: bytes each rank sends per step (counted the same way
    for all, see collector/comm.py) and the loss after the same number of steps.

On loopback, gloo's communication burns the same cores as the compute, so overlap can hide
little. `--link 3gbit` emulates a real link instead: two network namespaces joined by a veth
pair, rate-limited with tbf, one torchrun agent per namespace (needs root and iproute2; the
namespaces use 198.18.0.0/15 test addresses and are removed afterwards).

    .venv/bin/python benchmarks/comm_breakdown.py [--ranks 4 --steps 60 --link 3gbit]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from _common import REPO, machine

from meshscope.collector.store import load_steps
from meshscope.config import load_config

NS = "ms-bench-n1"
HOST_IF, PEER_IF = "msb0", "msb1"
HOST_IP, PEER_IP = "198.18.0.1", "198.18.0.2"


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


@contextlib.contextmanager
def emulated_link(rate: str) -> Iterator[None]:
    """A second 'node' in a network namespace behind a tbf-limited veth pair."""
    teardown()
    try:
        sh("ip", "netns", "add", NS)
        sh("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", PEER_IF)
        sh("ip", "link", "set", PEER_IF, "netns", NS)
        sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", HOST_IF)
        sh("ip", "link", "set", HOST_IF, "up")
        sh("ip", "netns", "exec", NS, "ip", "addr", "add", f"{PEER_IP}/24", "dev", PEER_IF)
        sh("ip", "netns", "exec", NS, "ip", "link", "set", PEER_IF, "up")
        sh("ip", "netns", "exec", NS, "ip", "link", "set", "lo", "up")
        tbf = ["tbf", "rate", rate, "burst", "256kb", "latency", "100ms"]
        sh("tc", "qdisc", "add", "dev", HOST_IF, "root", *tbf)
        sh("ip", "netns", "exec", NS, "tc", "qdisc", "add", "dev", PEER_IF, "root", *tbf)
        yield
    finally:
        teardown()


def teardown() -> None:
    subprocess.run(["ip", "link", "del", HOST_IF], capture_output=True)
    subprocess.run(["ip", "netns", "del", NS], capture_output=True)


def write_config(root: Path, name: str, args: argparse.Namespace, compression: str, overlap: bool) -> Path:
    cfg = load_config(
        REPO / "configs" / "demo.toml",
        {
            "run_id": name,
            "runs_root": str(root),
            "nproc": args.ranks,
            "metrics_port": args.port,
            "train": {
                "steps": args.steps,
                "compression": compression,
                "overlap": overlap,
                "bucket_cap_mb": args.bucket_mb,
            },
            "model": {"d_model": args.d_model},
        },
    )
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    path = cfg.run_dir / "config.json"
    path.write_text(cfg.model_dump_json())
    return path


def run_job(config: Path, args: argparse.Namespace) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    worker = ["-m", "meshscope.trainer.worker", "--config", str(config)]
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    if args.link == "none":
        env["GLOO_SOCKET_IFNAME"] = "lo"
        cmd = [*torchrun, "--standalone", f"--nproc-per-node={args.ranks}", *worker]
        subprocess.run(cmd, env=env, check=True, capture_output=True, cwd=REPO)
        return
    per_node = args.ranks // 2
    common = ["--nnodes=2", f"--nproc-per-node={per_node}", f"--master-addr={HOST_IP}", "--master-port=29517"]
    procs = [
        subprocess.Popen(
            [*torchrun, *common, "--node-rank=0", *worker],
            cwd=REPO,
            env=dict(env, GLOO_SOCKET_IFNAME=HOST_IF),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        ),
        subprocess.Popen(
            ["ip", "netns", "exec", NS, *torchrun, *common, "--node-rank=1", *worker],
            cwd=REPO,
            env=dict(env, GLOO_SOCKET_IFNAME=PEER_IF),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        ),
    ]
    for p in procs:
        _, err = p.communicate(timeout=900)
        if p.returncode:
            raise RuntimeError(err.decode()[-3000:])


def summarize(run_dir: Path, skip: int) -> dict[str, float]:
    df = load_steps(run_dir)
    df = df[df["step"] >= skip]
    med = df.groupby("step")[["step_s", "comm_total_s", "comm_exposed_s", "backward_s"]].mean().median()
    last = load_steps(run_dir)
    final = last[last["step"] >= last["step"].max() - 4]["loss"].mean()
    return {
        "step_s": med["step_s"],
        "comm_s": med["comm_total_s"],
        "exposed_s": med["comm_exposed_s"],
        "backward_s": med["backward_s"],
        # bytes after any compression warm-up: the last steps
        "wire_per_step": last[last["step"] >= last["step"].max() - 9]["bytes_wire"].mean(),
        "raw_per_step": df["bytes_raw"].mean(),
        "final_loss": final,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--bucket-mb", type=float, default=0.5)
    ap.add_argument("--link", default="none", help="none (loopback) or a tbf rate, e.g. 3gbit")
    ap.add_argument("--port", type=int, default=9700)
    args = ap.parse_args()
    modes = [
        ("overlap-none", "none", True),
        ("no-overlap-none", "none", False),
        ("overlap-fp16", "fp16", True),
        ("overlap-powersgd", "powersgd", True),
        ("overlap-onebit", "onebit", True),
    ]
    link = emulated_link(args.link) if args.link != "none" else contextlib.nullcontext()
    results = {}
    with tempfile.TemporaryDirectory() as tmp, link:
        for name, compression, overlap in modes:
            config = write_config(Path(tmp), name, args, compression, overlap)
            run_job(config, args)
            results[name] = summarize(config.parent, skip=5)
    report(results, args)


def report(r: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    print(f"machine: {machine()}")
    print(
        f"ranks={args.ranks} steps={args.steps} d_model={args.d_model} "
        f"bucket={args.bucket_mb} MB link={args.link}"
    )
    print(
        f"{'mode':18} {'step ms':>8} {'comm ms':>8} {'exposed ms':>10} {'backward ms':>11} "
        f"{'wire KB/step':>12} {'wire/none':>9} {'loss':>7}"
    )
    base_wire = r["overlap-none"]["wire_per_step"]
    for name, s in r.items():
        print(
            f"{name:18} {s['step_s'] * 1e3:8.1f} {s['comm_s'] * 1e3:8.1f} "
            f"{s['exposed_s'] * 1e3:10.1f} {s['backward_s'] * 1e3:11.1f} "
            f"{s['wire_per_step'] / 1e3:12.1f} {s['wire_per_step'] / base_wire:9.4f} "
            f"{s['final_loss']:7.3f}"
        )
    ov, no = r["overlap-none"], r["no-overlap-none"]
    removed = 1 - ov["exposed_s"] / no["exposed_s"] if no["exposed_s"] > 0 else float("nan")
    hidden = no["exposed_s"] - ov["exposed_s"]
    efficiency = hidden / min(no["comm_s"], ov["backward_s"] - ov["exposed_s"])
    print(
        f"overlap removes {removed:.1%} of exposed communication (target >= 60%); "
        f"overlap efficiency {efficiency:.2f} (hidden / min(comm, backward compute))"
    )
    onebit = r["overlap-onebit"]["wire_per_step"] / base_wire
    print(f"onebit sends {onebit:.4f} of none's bytes = 1/{1 / onebit:.1f} (target <= 1/16)")
    for name in ("overlap-fp16", "overlap-powersgd", "overlap-onebit"):
        gap = r[name]["final_loss"] / r["overlap-none"]["final_loss"] - 1
        print(f"loss after {args.steps} steps, {name}: {gap:+.1%} vs none (target within 2%)")


if __name__ == "__main__":
    main()
