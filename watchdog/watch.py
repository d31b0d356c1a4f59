"""The watchdog at runtime: `HangWatch` runs beside the workers (in the sidecar), never inside
them. It reads each rank's flight-log header from `<run>/live/` every `poll_s` (a few hundred
bytes per rank, no process group involved). When no rank has made progress for a threshold
derived from the recent step time, or a rank died without a clean exit, it asks the live ranks
for their Python stacks (`collector.stacks`), reads every rank's tail, asks the other nodes
(`exchange`) and hands the facts to `diagnose`.

A run directory is per node, so each node's watchdog reads its own ranks; without the
exchange, ranks it cannot see are reported as unseen, never blamed."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from meshscope.collector.flightread import (
    FlightLogError,
    FlightTail,
    latest_logs,
    read_flight,
)
from meshscope.collector.service import Service
from meshscope.collector.stacks import crash_stack, recorder_answer, request_stacks, stack_answer
from meshscope.watchdog.config import HangConfig
from meshscope.watchdog.diagnose import diagnose
from meshscope.watchdog.exchange import NodeExchange, OneNode
from meshscope.watchdog.flight_recorder import recorder_verdict
from meshscope.watchdog.verdicts import Diagnosis, Verdict

log = logging.getLogger("meshscope.hang")


def pid_alive(pid: int) -> bool:
    """A live process (a zombie, dead but not yet reaped by torchrun, counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


CLOCK_SKEW_S = 1.0  # how far nodes' clocks may disagree when a verdict is matched to a stall


class HangWatch(Service):
    """Watches one node's ranks through their flight logs; see the module doc."""

    def __init__(
        self,
        live_dir: Path,
        config: HangConfig | None = None,
        on_hang: Callable[[Diagnosis], None] = lambda d: None,
        clock: Callable[[], float] = time.time,
        leader: Callable[[], bool] = lambda: True,
        exchange: NodeExchange | OneNode | None = None,
        judge: Callable[[], bool] = lambda: True,
    ) -> None:
        self.live_dir = Path(live_dir)
        self.exchange = exchange or OneNode()  # several nodes: tails and stacks through the store
        self.leader = leader  # agents sharing a run directory: one watches
        # several nodes: the job's judge gathers every node's picture and posts the verdict;
        # the others answer and act on it (one request per stall, not one per node)
        self.judge = judge
        self.config = config or HangConfig()
        self.on_hang, self.clock = on_hang, clock
        self.diagnosed: dict[frozenset, float] = {}  # attempt -> its progress when diagnosed
        self.last: Diagnosis | None = None
        super().__init__("meshscope-hang", self.config.poll_s, join_s=10)

    def round(self) -> None:
        """One look (a failed one is logged and counted, never the end of training)."""
        self.poll()

    def poll(self) -> Diagnosis | None:
        """One look; a diagnosis (also handed to `on_hang`) when this attempt is stuck."""
        if not self.live_dir.is_dir() or not self.leader():
            return None
        heads = self._heads()
        if not heads:
            return None
        try:
            self._answer(heads)
        except Exception as err:  # the store is not up (yet): this node answers later
            log.debug("hang exchange: %s", err)
        attempt = frozenset((r, h.pid) for r, h in heads.items())
        progress = max(h.progress_t for h in heads.values())
        if attempt in self.diagnosed and self.diagnosed[attempt] >= progress:
            return None  # diagnosed, and nothing moved since (a new stall is judged anew)
        if all(h.closed for h in heads.values()) and not any(h.last_error for h in heads.values()):
            return None  # a clean end
        world = max(h.world_size for h in heads.values())
        alive = {r: pid_alive(h.pid) for r, h in heads.items()}
        # a rank told to stop (its agent restarting the job, the user cancelling) may stall or
        # end on its way out: neither a hang nor a crash; the ranks that made it stop are
        # named by their own node, or by the heartbeats if that node is gone
        dead = [r for r, h in heads.items() if not h.left and not alive[r]]
        running = [h for r, h in heads.items() if not h.left and alive[r]]
        failed = any(h.closed and h.last_error for h in heads.values())
        if not dead and not failed and running:
            idle = self.clock() - max(h.progress_t for h in running)
            if idle < self.config.threshold_s(max(h.step_s for h in running)):
                return None
            # a watchdog delayed between reading the headers and now (a busy host) must not
            # mistake its own delay for the ranks': read them again
            if max(h.progress_t for h in self._heads().values()) > progress:
                return None
        elif not dead and not failed:
            return None
        if self.exchange.several_nodes and not self.judge():
            return self._follow(heads, attempt, alive)
        # a crash is judged once per attempt; a stall again if progress resumes and stops
        self.diagnosed[attempt] = float("inf") if dead or failed else progress
        tails, stacks, dumps = self._local_picture(
            heads, [r for r, h in heads.items() if alive[r] and not h.closed]
        )
        if len(tails) < world:  # one node: what it sees is the whole picture
            tails, stacks = self._gather_job(tails, stacks, world)
        diag = diagnose(tails, world, alive=alive, stacks=stacks)
        with_recorder(diag, dumps, world)
        diag.detected_at = self.clock()
        diag.evidence["stalled_since"] = max((h.progress_t for h in heads.values()), default=0.0)
        diag.pids = {str(r): h.pid for r, h in heads.items()}
        diag.step = fault_step(diag, tails)
        diag.evidence["host_step"] = max((t.step for t in tails.values()), default=-1)
        if len(tails) > len(heads):  # other nodes' ranks in it: they act on this verdict
            try:
                self.exchange.post_verdict(diag.detail())
            except Exception as err:  # the others then judge their own stall after their wait
                log.warning("hang verdict not posted to the other nodes: %s", err)
        self.last = diag
        self.on_hang(diag)
        return diag

    def _gather_job(
        self, tails: dict[int, FlightTail], stacks: dict[int, list[str]], world: int
    ) -> tuple[dict[int, FlightTail], dict[int, list[str]]]:
        """The judge asks every node for its picture once, and merges what arrives in time."""
        try:
            request_id = f"{os.getpid()}-{self.clock():.6f}"
            self.exchange.request(request_id)
            self.exchange.publish(request_id, tails, stacks)
            remote_tails, remote_stacks = self.exchange.gather(
                request_id, world, self.config.stacks_wait_s + 4 * self.config.poll_s, mine=(tails, stacks)
            )
            return {**remote_tails, **tails}, {**remote_stacks, **stacks}
        except Exception as err:  # no store: diagnose what this node sees
            log.warning("hang exchange with other nodes failed: %s", err)
            return tails, stacks

    def _follow(
        self, heads: dict[int, FlightTail], attempt: frozenset, alive: dict[int, bool]
    ) -> Diagnosis | None:
        """Not the job's judge: act (abort this node's ranks) on the judge's verdict about
        this stall (one detected after this node's ranks last progressed, not an older one)."""
        stalled_since = max(h.progress_t for h in heads.values())
        try:
            verdicts = self.exchange.new_verdicts()
        except Exception as err:  # the store is not up (yet)
            log.debug("hang exchange: %s", err)
            return None
        verdicts = [v for v in verdicts if v.get("detected_at", 0.0) >= stalled_since - CLOCK_SKEW_S]
        if not verdicts:
            return None
        diag = Diagnosis.from_detail(verdicts[-1])
        diag.pids = {str(r): h.pid for r, h in heads.items() if alive.get(r)}
        self.diagnosed[attempt] = stalled_since
        self.last = diag
        self.on_hang(diag)
        return diag

    def _answer(self, heads: dict[int, FlightTail]) -> None:
        """Other nodes' watchdogs asked: send this node's tails and stacks."""
        requests = self.exchange.pending()
        if not requests:
            return
        tails, stacks, _ = self._local_picture(
            heads, [r for r, h in heads.items() if not h.closed and pid_alive(h.pid)]
        )
        for request_id in requests:
            self.exchange.publish(request_id, tails, stacks)

    def _heads(self) -> dict[int, FlightTail]:
        """The newest attempt's flight-log header of each rank of this node."""
        return latest_logs(self.live_dir)

    def _local_picture(
        self, heads: dict[int, FlightTail], live: list[int]
    ) -> tuple[dict[int, FlightTail], dict[int, list[str]], dict[int, Path]]:
        """This node's ranks: every flight-log tail, the live ranks' stacks (and Flight
        Recorder dumps, where the backend keeps one), and the crash stacks of the ranks that
        could not answer."""
        stacks, dumps = self._gather_stacks(live, heads)
        tails = {}
        for rank, head in heads.items():
            try:
                tails[rank] = read_flight(head.path)
            except (OSError, FlightLogError):
                continue
        for rank, head in heads.items():
            if rank not in stacks:
                crash = crash_stack(head.path)
                if crash:
                    stacks[rank] = crash
        return tails, stacks, dumps

    def _gather_stacks(
        self, ranks: list[int], heads: dict[int, FlightTail]
    ) -> tuple[dict[int, list[str]], dict[int, Path]]:
        """Ask the live ranks for their stacks (and, where the backend keeps one, its Flight
        Recorder dump) and wait a little for the answers."""
        request_id = f"{self.clock():.6f}"
        request_stacks(self.live_dir, request_id)
        deadline = time.monotonic() + self.config.stacks_wait_s
        stacks: dict[int, list[str]] = {}
        while time.monotonic() < deadline and len(stacks) < len(ranks):
            for rank in ranks:
                if rank not in stacks:
                    answer = stack_answer(heads[rank].path, request_id)
                    if answer is not None:
                        stacks[rank] = answer
            time.sleep(0.05)
        # the dump is written before the stacks: whoever answered has dumped, if it can
        dumps = {r: recorder_answer(heads[r].path, request_id) for r in stacks}
        return stacks, {r: p for r, p in dumps.items() if p is not None}


def with_recorder(diag: Diagnosis, dumps: dict[int, Path], world: int) -> Diagnosis:
    """Add what the backend's own Flight Recorder says (its dumps of this round). Everyone in
    the collective is all the flight log can say; the recorder's device states can name the
    ranks whose device never started it, and then its culprits are the verdict's."""
    if not dumps:
        return diag
    recorded = recorder_verdict(dumps, world)
    if recorded is None:
        return diag
    diag.evidence["flight_recorder"] = {
        "type": recorded.kind.value,
        "culprit_ranks": recorded.culprit_ranks,
        "op": recorded.op,
        "seq": recorded.seq,
        "why": recorded.why,
        "ranks": sorted(dumps),
    }
    if diag.kind == Verdict.STUCK and not diag.culprit_ranks and recorded.kind == Verdict.STUCK:
        if recorded.culprit_ranks:
            diag.culprit_ranks = recorded.culprit_ranks
            diag.why = f"{diag.why}; the backend's Flight Recorder: {recorded.why}"
            diag.evidence["source"] = f"{diag.evidence.get('source', '')}, flight recorder".lstrip(", ")
    return diag


def diagnose_folder(live_dir: Path) -> Diagnosis | None:
    """A post-mortem: the newest attempt's flight logs, crash dumps and last stacks."""
    heads = latest_logs(live_dir) if Path(live_dir).is_dir() else {}
    if not heads:
        return None
    tails = {r: read_flight(h.path) for r, h in heads.items()}
    stacks = {}
    for rank, head in heads.items():
        stack = crash_stack(head.path) or stack_answer(head.path, None)
        if stack:
            stacks[rank] = stack
    world = max(h.world_size for h in heads.values())
    alive = {r: pid_alive(h.pid) for r, h in heads.items()}
    return diagnose(tails, world, alive=alive, stacks=stacks)


def fault_step(diag: Diagnosis, tails: dict[int, FlightTail]) -> int:
    """The step the stall began at, as the verdict's header shows it: where a desync started,
    else the step of the collective the verdict names (the earliest rank's), else the step the
    furthest rank is in (a rank that skipped runs on for steps: its step is not the fault's)."""
    since = diag.evidence.get("desync_since_step")
    if since is not None:
        return int(since)
    if diag.group is not None and diag.seq is not None:
        steps = [r.step for t in tails.values() if (r := t.record(diag.group, diag.seq)) and r.step >= 0]
        if steps:
            return min(steps)
    return max((t.current_step for t in tails.values()), default=-1)
