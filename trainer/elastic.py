"""One worker's part in surviving failures: resume, checkpoints, heartbeats, restart accounting.

Events written here: `restart` (a new torchrun attempt), `fault` (the rank of the previous
attempt that died, or a peer found dead by heartbeats), `resume` (from which checkpoint, steps
lost), `checkpoint` (refused ones, with the reason).
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

import torch

from meshscope.collector import DistEnv, Monitor
from meshscope.collector.control import ControlPlane, LateFlag
from meshscope.collector.env import process_start_time
from meshscope.collector.report import after_abort, watchdog_aborts
from meshscope.collector.store import load_events, load_steps
from meshscope.collector.storedb import NodeDir
from meshscope.trainer.checkpoint import CheckpointManager
from meshscope.trainer.config import TrainerConfig
from meshscope.trainer.heartbeat import (
    PREFIX,
    Heartbeat,
    JobWatch,
    NodeWatch,
    connect_store,
    exit_marks,
    previous_attempt_failures,
    world_of,
)

log = logging.getLogger(__name__)


def heartbeat_endpoint(cfg: TrainerConfig, env: DistEnv) -> tuple[str, int]:
    """Where beats and exit marks go: the rendezvous store when there is one (it outlives every
    agent), else the agent's store (it outlives the workers' restarts)."""
    if cfg.elastic.rdzv_endpoint:
        host, _, port = cfg.elastic.rdzv_endpoint.rpartition(":")
        return host, int(port)
    return env.master_addr, env.master_port


def attempt_id(env: DistEnv) -> int:
    """torchrun's restart count: it names this attempt in the store's keys."""
    return env.restart_count


class ElasticRun:
    """A worker's elastic side: checkpoints, resume, heartbeats and the agreed stop."""

    def __init__(
        self,
        cfg: TrainerConfig,
        env: DistEnv,
        mon: Monitor,
        started_at: float | None = None,
        control: ControlPlane | None = None,
    ) -> None:
        self.cfg, self.env, self.mon = cfg, env, mon
        self.control = control
        self._stop_flag = LateFlag(control) if control is not None else None
        self.stop_requested = False
        self.store = connect_store(*heartbeat_endpoint(cfg, env), job=cfg.job_id) if env.torchrun else None
        every = cfg.elastic.checkpoint_every
        self.ckpt = (
            CheckpointManager(
                cfg.run_dir / "checkpoints",
                rank=env.rank,
                world_size=env.world_size,
                keep=cfg.elastic.keep,
                async_save=cfg.elastic.async_checkpoint,
                node=env.group_rank,
            )
            if every
            else None
        )
        self.heartbeat: Heartbeat | None = None
        self.watchers: list[Any] = []
        self._fault_time: float | None = None
        self.group_ready_at = time.time()  # built after the process group
        self.started_at = started_at if started_at is not None else process_start_time()
        self._resumed_at: int | None = None
        self.resumed_controls: dict | None = None  # the approved changes' values at the checkpoint
        self.round = 0

    # --- start --------------------------------------------------------------------------
    def start(self) -> None:
        """Account for the previous attempt, then start beating and listen for SIGTERM."""
        if self.store is not None:
            self.round = self._agree_round()
            self._report_previous_attempt()
            interval = self.cfg.elastic.heartbeat_s
            self.heartbeat = Heartbeat(
                self.store,
                rank=self.env.rank,
                world_size=self.env.world_size,
                attempt=self.round,
                interval_s=interval,
            ).start()
            self.watchers = self._watchers(interval)
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _agree_round(self) -> int:
        """A number for this group, the same on every rank and new in every round, from a
        counter in the persistent store. torchrun's restart count will not do: a newcomer
        starts at 0 while survivors have counted their restarts, and stale keys of an old
        round with the same count would look like peers that stopped beating."""
        value = self.store.add(f"{PREFIX}/round", 1) - 1 if self.env.rank == 0 else 0
        return self.control.broadcast_int(value) if self.control is not None else value

    def _report_previous_attempt(self) -> None:
        attempt = self.round
        if attempt == 0:
            return
        self.mon.metrics.restarts.inc(max(1, self.env.restart_count))
        failures = previous_attempt_failures(self.store, attempt)
        then = world_of(self.store, attempt - 1) or self.env.world_size
        marks = exit_marks(self.store, attempt - 1, then)
        self._fault_time = min(marks.values()) if marks else time.time()
        if self.env.rank == 0:
            self.mon.event(
                "restart", severity="warning", detail={"attempt": attempt, "world_size": self.env.world_size}
            )
            aborts = self._watchdog_aborts()
            for f in failures:
                if after_abort(f.last_seen, aborts):  # the watchdog's own abort: its hang event says so
                    continue
                self.mon.metrics.faults.labels(kind="dead_rank").inc()
                self.mon.event(
                    "fault",
                    severity="critical",
                    step=f.last_step,
                    detail={
                        "type": "dead_rank",
                        "rank": f.rank,
                        "attempt": attempt - 1,
                        "last_seen": f.last_seen,
                        "detected_at": self._fault_time,
                        "how": "no exit mark: the process died without being stopped",
                    },
                )

    def _watchdog_aborts(self) -> list[float]:
        """When the hang watchdog aborted this run's workers (none when the store says nothing)."""
        try:
            return watchdog_aborts(load_events(self.cfg.run_dir, kind="hang"))
        except Exception:  # no store yet, or one that does not answer: every death is a fault
            return []

    def _watchers(self, interval: float) -> list[Any]:
        """The node's watcher on local rank 0, the job's on rank 0 when there are several
        nodes (each reads its own connection to the store)."""
        env, out = self.env, []
        per_node = env.local_world_size
        if env.local_rank == 0:
            out.append(
                NodeWatch(
                    connect_store(*heartbeat_endpoint(self.cfg, env), job=self.cfg.job_id),
                    attempt=self.round,
                    node=env.rank // per_node,
                    ranks=env.local_ranks(),
                    interval_s=interval,
                    on_dead=self._peer_dead,
                    on_age=self._peer_age,
                ).start()
            )
        if env.rank == 0 and env.world_size > per_node:
            nodes = {
                n: list(range(n * per_node, min((n + 1) * per_node, env.world_size)))
                for n in range(-(-env.world_size // per_node))
            }
            out.append(
                JobWatch(
                    connect_store(*heartbeat_endpoint(self.cfg, env), job=self.cfg.job_id),
                    attempt=self.round,
                    nodes=nodes,
                    interval_s=interval,
                    on_dead=self._peer_dead,
                ).start()
            )
        return out

    def _peer_dead(self, peer: int, age: float, step: int) -> None:
        self.mon.metrics.faults.labels(kind="dead_rank").inc()
        self.mon.event(
            "fault",
            severity="critical",
            step=step,
            detail={
                "type": "dead_rank",
                "rank": peer,
                "heartbeat_age_s": round(age, 3),
                "how": "heartbeat stopped",
            },
        )
        self.mon.store.flush()

    def _peer_age(self, peer: int, age: float | None) -> None:
        """Export a local rank's beat age; None: it departed, its series goes."""
        gauge = self.mon.metrics.heartbeat_age
        if age is None:
            try:
                gauge.remove(str(peer))
            except KeyError:
                pass
        else:
            gauge.labels(peer=str(peer)).set(age)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self.heartbeat is not None:
            self.heartbeat.mark_exit("sigterm")
        if self.mon.flight is not None:  # the hang watchdog: leaving on purpose, not stuck
            self.mon.flight.stopping()
        self.stop_requested = True

    def linger(self, seconds: float) -> None:
        """Keep the process, and its /metrics, up for `seconds` after the last step, for a last
        scrape; a SIGTERM ends it at once (a plain sleep would outlast the agent's grace)."""
        end = time.monotonic() + seconds
        while not self.stop_requested and (left := end - time.monotonic()) > 0:
            time.sleep(min(0.1, left))

    # --- resume -------------------------------------------------------------------------
    @property
    def resumed_at(self) -> int | None:
        """The step the run resumed at from a checkpoint (None: it started afresh)."""
        return self._resumed_at

    def resume(self, state: Any) -> None:
        """Load the newest valid checkpoint into the train state (model, optimizer, step,
        RNG, compression error feedback) and say what was lost."""
        if self.ckpt is None:
            return
        if state.experts is not None:  # expert parallelism: experts are saved as shards
            from meshscope.trainer.experts import ShardedExperts

            self.ckpt.sharded = ShardedExperts(state.model, state.experts.mesh)
        restored, refused = self.ckpt.restore(state.model, state.optimizer)
        if self.env.rank == 0:
            for reason in refused:
                self.mon.event("checkpoint", severity="warning", detail={"refused": reason})
        if restored is None:
            return
        local = self.ckpt.local_state(restored)
        self.resumed_controls = (local or {}).get("controls")  # for the ControlApplier, built next
        if local is not None:
            torch.set_rng_state(local["rng"])
            if local.get("hook") is not None and hasattr(state.hook_state, "load_state_dict"):
                state.hook_state.load_state_dict(local["hook"])
        state.step = restored.step
        self._resumed_at = restored.step
        if self.env.rank == 0:
            recorded = self._last_recorded_step()
            self.mon.event(
                "resume",
                severity="warning",
                step=restored.step,
                detail={
                    "checkpoint": restored.path.name,
                    "from_step": restored.step,
                    "steps_lost": max(0, recorded + 1 - restored.step),
                    "world_size_then": restored.world_size,
                    "world_size_now": self.env.world_size,
                    # where a recovery's time goes (benchmarks/fault_recovery.py reads these)
                    "detected_at": self._fault_time,
                    "process_started_at": self.started_at,
                    "group_ready_at": self.group_ready_at,
                    "restored_at": time.time(),
                },
            )

    def _last_recorded_step(self) -> int:
        try:
            steps = load_steps(NodeDir(self.cfg.run_dir))  # its own rows: no wait on the job store
        except FileNotFoundError:
            return -1
        return int(steps["step"].max()) if not steps.empty else -1

    # --- during training ------------------------------------------------------------------
    def should_checkpoint(self, step: int) -> bool:
        """Whether this step ends with a checkpoint."""
        every = self.cfg.elastic.checkpoint_every
        return self.ckpt is not None and step > 0 and step % every == 0

    def checkpoint(self, state: Any) -> None:
        """Save model, optimizer, hook state and RNG (DCP, in the background when asked)."""
        started = time.perf_counter()
        # every step before the checkpoint is in this rank's store first: a node lost right
        # after it resumes there without a hole in its steps (its window was still in memory).
        # First, too: the flush hands the expert window to the routing-bias update, which the
        # state below must already hold (else a resume misses the update the run made here)
        self.mon.flush()
        hook = state.hook_state.state_dict() if hasattr(state.hook_state, "state_dict") else None
        controls = state.applier.state_dict() if getattr(state, "applier", None) is not None else None
        local = {"rng": torch.get_rng_state(), "hook": hook, "step": state.step, "controls": controls}
        self.ckpt.save(state.step, state.model, state.optimizer, local)
        if self.env.rank == 0:  # on the timeline: a step it holds up is meshscope's, not a fault
            held = round(time.perf_counter() - started, 4)
            detail = {"saved_step": state.step, "held_s": held, "async": self.cfg.elastic.async_checkpoint}
            self.mon.event("checkpoint", step=state.step, detail=detail)

    def after_step(self, state: Any) -> None:
        """Beat, and checkpoint when due."""
        if self.heartbeat is not None:
            self.heartbeat.step = state.step
        if (
            self._fault_time is not None
            and self._resumed_at is not None
            and state.step == self._resumed_at + 1
        ):
            self.mon.metrics.recovery.set(time.time() - self._fault_time)

    def agreed_stop(self) -> bool:
        """All ranks learn together that one was asked to stop, so they checkpoint at the same
        step. One tiny host all-reduce per step (only when checkpoints are on), read a step
        late: the step that raises the flag never waits for it, and the device never does."""
        if self.ckpt is None or self._stop_flag is None:
            return self.stop_requested
        return self._stop_flag.exchange(self.stop_requested)

    def mark_failed(self, err: BaseException) -> None:
        """Tell the peers this rank ends with an error, then let a staged checkpoint land."""
        if self.heartbeat is not None:
            try:
                self.heartbeat.mark_exit(f"error:{type(err).__name__}")
            except Exception:  # the store may be gone too
                pass
        self._settle_checkpoint()

    def _settle_checkpoint(self) -> None:
        """A collective error leaves the checkpoint's own group whole: the save can finish, and
        without it the restart would begin from the one before (or from step 0)."""
        if self.ckpt is None:
            return
        if not self.ckpt.wait(timeout=self.cfg.elastic.settle_checkpoint_s):
            log.warning(
                "the checkpoint in flight did not land within %.0f s; the restart uses the one before",
                self.cfg.elastic.settle_checkpoint_s,
            )

    def finish(self, state: Any, reason: str) -> None:
        """Settle the stop flag, finish checkpoints, and say a clean goodbye."""
        if self._stop_flag is not None:
            self._stop_flag.settle()  # no exchange left in flight when the group goes
        if self.ckpt is not None:
            if reason == "sigterm":
                self.checkpoint(state)
            self.ckpt.wait()
        if self.heartbeat is not None:
            self.heartbeat.mark_exit(reason)
            for watcher in self.watchers:
                watcher.stop()
            self.heartbeat.stop()
