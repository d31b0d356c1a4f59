"""torchrun worker entry: `python -m trainer.worker --config RUN_DIR/config.json`.

Parse, build, run, close. The launcher (meshscope run) writes the resolved config.
"""
from __future__ import annotations

import argparse
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from collector import DistEnv, Monitor, MonitorConfig
from trainer.config import RunConfig, load_config
from trainer.device import resolve_device
from trainer.loop import build, train


def init_process_group(env: DistEnv, backend: str) -> None:
    """One process group per torchrun attempt: a per-attempt prefix keeps restarted workers from
    reading a dead peer's address out of the agent's store (NOTES: gloo restart pitfall)."""
    if not env.is_distributed:
        return
    store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False,
                          timeout=timedelta(seconds=120))
    prefixed = dist.PrefixStore(f"attempt_{env.restart_count}", store)
    dist.init_process_group(backend, store=prefixed, rank=env.rank, world_size=env.world_size,
                            timeout=timedelta(seconds=600))


def run_worker(cfg: RunConfig, env: DistEnv) -> None:
    device = resolve_device(cfg.device, env.local_rank)
    device.activate()
    init_process_group(env, device.backend)
    mon = Monitor(MonitorConfig(run_dir=cfg.run_dir, run_id=cfg.run_id,
                                metrics_port=cfg.metrics_port, expert_every=cfg.expert_every),
                  env=env, probe=device.probe())
    try:
        mon.describe_run(device=device.kind, backend=device.backend,
                         compression=cfg.train.compression)
        state = build(cfg, device, mon, rank=env.rank, world_size=env.world_size)
        train(state, mon, cfg, device)
        mon.flush()
        if dist.is_initialized():
            dist.barrier()  # a clean shutdown: no rank tears down gloo while a peer still talks
        if env.rank == 0:
            mon.event("run_end", detail={"steps": state.step})
        time.sleep(cfg.linger_s)  # lets Prometheus take a last scrape of short runs
    finally:
        mon.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", type=Path, required=True, help="resolved run config (JSON)")
    args = parser.parse_args(argv)
    run_worker(load_config(args.config), DistEnv.from_environ())


if __name__ == "__main__":
    main()
