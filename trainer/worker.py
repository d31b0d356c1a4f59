"""torchrun worker entry: `python -m trainer.worker --config RUN_DIR/config.json`.

Parse, build, run, close. The launcher (meshscope run) writes the resolved config and starts
`meshscope.worker`, which runs this with the tensor tracer wired in; `ENTRY_ENV` names the
entry module for the warm standby and its fallback.
"""

from __future__ import annotations

import time

STARTED_AT = time.time()  # before the heavy imports: recovery accounting counts them

import argparse  # noqa: E402
import gc  # noqa: E402
import os  # noqa: E402
from collections.abc import Callable  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch.distributed as dist  # noqa: E402

from meshscope.collector import DistEnv, Monitor, MonitorConfig  # noqa: E402
from meshscope.collector.control import ControlPlane  # noqa: E402
from meshscope.collector.flightlog import FlightLog  # noqa: E402
from meshscope.collector.store import load_events  # noqa: E402
from meshscope.collector.storedb import NodeDir  # noqa: E402
from meshscope.collector.syncaudit import SyncAudit  # noqa: E402
from meshscope.trainer.config import TrainerConfig, load_config  # noqa: E402
from meshscope.trainer.controls import ControlApplier  # noqa: E402
from meshscope.trainer.device import accelerator_module, process_group_timeout_s, resolve_device  # noqa: E402
from meshscope.trainer.elastic import ElasticRun, attempt_id  # noqa: E402
from meshscope.trainer.forksafe import die_with_parent  # noqa: E402
from meshscope.trainer.inject import Injection, Injector, parse_injection  # noqa: E402
from meshscope.trainer.loop import build, train  # noqa: E402


def init_process_group(env: DistEnv, backend: str, kind: str = "cpu") -> None:
    """One process group per torchrun attempt.

    On the agent's store, which outlives restarts, a per-attempt prefix keeps restarted workers
    from reading a dead peer's address (gloo's restart pitfall). With several agents the
    launcher turns store sharing off: every rendezvous round then gets a fresh store hosted by
    rank 0, and agents whose restart counts differ (a newcomer) still meet."""
    if not env.is_distributed:
        return
    store = dist.TCPStore(
        env.master_addr,
        env.master_port,
        env.world_size,
        is_master=not env.agent_store and env.rank == 0,
        timeout=timedelta(seconds=120),
    )
    if env.agent_store:
        store = dist.PrefixStore(f"attempt_{attempt_id(env)}_w{env.world_size}", store)
    dist.init_process_group(
        backend,
        store=store,
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=process_group_timeout_s(kind)),
    )


def fired_injections(cfg: TrainerConfig) -> set[str]:
    """Injections earlier attempts already fired (a resumed run is not killed twice), from this
    node's own store: where its ranks recorded them, readable when the job store is not."""
    try:
        events = load_events(NodeDir(cfg.run_dir), kind="injected")
    except FileNotFoundError:
        return set()
    return {d["key"] for d in events["detail"]}


def make_injector(cfg: TrainerConfig, env: DistEnv, mon: Monitor) -> Injector:
    """The fault injector of this rank, reporting each firing as an event."""

    def report(inj: Injection, step: int) -> None:
        mon.metrics.faults.labels(kind="injected").inc()
        mon.event(
            "injected",
            severity="warning",
            step=step,
            detail={
                "key": inj.key,
                "kind": inj.kind,
                "rank": inj.rank,
                "start_step": inj.step,
                "steps": inj.steps,
                "params": inj.params,
            },
        )

    return Injector(
        [parse_injection(s) for s in cfg.inject],
        env.rank,
        report,
        already_fired=fired_injections(cfg),
        flush=mon.flush,
    )


def write_pid(cfg: TrainerConfig, env: DistEnv) -> None:
    """`<run>/pids/rank<r>.pid`: which process is which rank (workers may be forked, not exec'd)."""
    folder = cfg.run_dir / "pids"
    folder.mkdir(exist_ok=True)
    (folder / f"rank{env.rank}.pid").write_text(str(os.getpid()))


# (cfg, env, monitor, model) -> (tracer, gradient inspector), either None: the tracer has
# step_begin(step) / step_end(loss=, grad_norm=, rerun=) / close(), the inspector
# before_clip(step) / after_update() / close()
TracerFactory = Callable[[TrainerConfig, DistEnv, Monitor, Any], tuple[Any, Any]]


def build_monitor(cfg: TrainerConfig, env: DistEnv, device: Any, control: Any) -> Monitor:
    """The rank's Monitor, as a user's loop would build it: the run's `[monitor]` settings.
    Unless they say otherwise, every step is timed in full: the detectors judge its phases."""
    settings = cfg.monitor.model_dump()
    if settings["detail_every"] is None:
        settings["detail_every"] = 1
    config = MonitorConfig(run_dir=cfg.run_dir, run_id=cfg.run_id, **settings)
    return Monitor(config, env=env, probe=device.probe(), control=control)


def start_audit(cfg: TrainerConfig, device: Any) -> SyncAudit | None:
    """The sync audit, when asked for: steps are the flight log's (none before the first)."""
    if not cfg.audit_syncs:
        return None

    def step() -> int:
        log = FlightLog._active
        return log.step if log is not None else -1

    audit = SyncAudit(step, host_is_device=device.kind == "sim")
    return audit.install(None if device.kind == "cpu" else accelerator_module(device.kind))


def run_worker(cfg: TrainerConfig, env: DistEnv, make_tracer: TracerFactory | None = None) -> None:
    """One rank of the reference trainer; `make_tracer` (from the composition root) adds the
    tensor tracer, which this package does not import."""
    die_with_parent()  # torchrun (or the warm standby) gone: this rank goes too
    device = resolve_device(cfg.device, env.local_rank, backend=cfg.backend)
    device.activate()
    audit = start_audit(cfg, device)
    init_process_group(env, device.backend, device.kind)
    control = ControlPlane.maybe()  # every collective meshscope adds goes through it
    mon = build_monitor(cfg, env, device, control)
    elastic = ElasticRun(cfg, env, mon, started_at=STARTED_AT, control=control)
    write_pid(cfg, env)
    try:
        mon.describe_run(device=device.kind, backend=device.backend, compression=cfg.train.compression)
        elastic.start()
        injector = make_injector(cfg, env, mon)
        state = build(cfg, device, mon, rank=env.rank, world_size=env.world_size, injector=injector)
        if make_tracer is not None:
            state.tracer, state.inspector = make_tracer(cfg, env, mon, state.model)
        elastic.resume(state)
        applier = ControlApplier(
            state.model,
            mon,
            cfg.run_dir,
            rank=env.rank,
            every=cfg.control_every,
            plane=control,
            expert_every=cfg.monitor.expert_every,
            optimizer=state.optimizer,
        )
        state.applier = applier  # checkpointed; a resume replays what came after its checkpoint
        applier.replay_applied(elastic.resumed_at, elastic.resumed_controls)
        try:
            freeze_heap()
            reason = train(state, mon, cfg, device, elastic, injector, applier)
            if audit is not None:
                audit.uninstall()  # the steps are over: what follows is shutdown
        except Exception as err:
            mon.fail(err)
            elastic.mark_failed(err)  # we failed, we did not vanish: not the culprit
            raise
        for looker in filter(None, (state.tracer, state.inspector)):
            looker.close()
        mon.flush()
        elastic.finish(state, reason)
        # done, or stopped by SIGTERM: every rank agreed on the same step, so all end here
        if control is not None:
            control.barrier()  # a clean shutdown: no rank tears down gloo while a peer talks
        if env.rank == 0:
            mon.event("run_end", detail={"steps": state.step, "reason": reason})
        if reason == "done":
            mon.training_over()
            elastic.linger(cfg.linger_s)  # lets Prometheus take a last scrape of short runs
    finally:
        if audit is not None:
            audit.uninstall()
            audit.write(cfg.run_dir / "sync_audit" / f"rank{env.rank}.json")
        mon.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def freeze_heap() -> None:
    """What is built before the first step (torch, pandas, the model, the Monitor) lives as
    long as the run: collect once and freeze it, so Python's cyclic GC never walks it again.
    Unfrozen, a full collection walks ~350,000 objects here (~150 ms on this 2-core host) at
    a step no two ranks share: the others wait for it in the next collective, a straggler
    that is the collector's (Megatron-LM's `--manual-gc` exists for the same stall)."""
    gc.collect()
    gc.freeze()


ENTRY_ENV = "MESHSCOPE_WORKER_ENTRY"  # the module whose main() a worker runs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The worker's one flag: the resolved run config."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", type=Path, required=True, help="resolved run config (JSON)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Run one rank of the reference trainer (no tracer)."""
    run_worker(load_config(parse_args(argv).config, own_sections=True), DistEnv.from_environ())


if __name__ == "__main__":
    main()
