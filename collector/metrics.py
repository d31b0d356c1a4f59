"""Every Prometheus family meshscope exports, declared once: the source of truth of the catalogue.

Topology (run, rank, node) comes from target labels in `targets.json`, never from metric labels;
labels here are intrinsic and bounded (phase, kind, layer, expert, detector, type, peer).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Collection, Iterator, Sequence

import numpy as np
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from meshscope.collector.schema import HOP_KINDS, StepRecord

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
PHASES = ("forward", "backward", "optimizer", "comm_exposed", "data")
FAULT_KINDS = ("dead_rank", "hang", "nonfinite", "injected")
# The series budget: what one rank exports whatever the size of the job (41 counted on 2- and
# 4-rank runs, with headroom), and what rank 0 adds: expert tokens and load ratio per
# (layer, expert), the imbalance per layer, gradient norm and update ratio per inspected
# layer; and each node's local rank 0 the heartbeat age of its ranks. A job of W ranks exports
# about W * (SERIES_PER_RANK + 1) + rank0_extra_series(...) series.
SERIES_PER_RANK = 45
# ... plus, under expert parallelism, one series per MoE layer: the tokens the rank's experts
# processed (`meshscope_expert_work_tokens_total{layer}`).


def rank0_extra_series(layers: int, experts: int, inspected_layers: int) -> int:
    """The series rank 0 exports beyond every rank's: expert load, and the gradient inspector."""
    return 2 * layers * experts + layers + 2 * inspected_layers


def node_leader_extra_series(ranks_per_node: int) -> int:
    """The series each node's local rank 0 exports beyond every rank's: its node watcher's
    heartbeat age of every rank on the node (`meshscope_heartbeat_age_seconds{peer}`)."""
    return ranks_per_node


def faults_counter(registry: CollectorRegistry) -> Counter:
    """`meshscope_faults_total{kind}`, declared once for the ranks and the watchers beside them."""
    return Counter(
        "meshscope_faults_total", "Faults seen, by kind (FAULT_KINDS).", ["kind"], registry=registry
    )


class MeshscopeMetrics:
    """The metric families of one process, registered on `registry`."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self._registry = registry
        self._step_families(registry)
        self._layer_families(registry)
        self._fault_families(registry)
        self._touch_known_children()

    def _step_families(self, r: CollectorRegistry) -> None:
        """What every step of this rank measures."""
        self.step_duration = Histogram(
            "meshscope_step_duration_seconds",
            "Wall time of one training step on this rank.",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.step_phase = Gauge(
            "meshscope_step_phase_seconds", "Last step's time per phase.", ["phase"], registry=r
        )
        self.steps = Counter("meshscope_steps_total", "Training steps completed.", registry=r)
        self.tokens = Counter("meshscope_tokens_total", "Tokens processed; tokens/s = rate().", registry=r)
        self.comm_ratio = Gauge(
            "meshscope_comm_ratio", "Exposed communication time / step time (0..1).", registry=r
        )
        self.comm_seconds = Counter(
            "meshscope_comm_seconds_total",
            "Gradient communication time; kind=total (in flight, sampled and scaled)|exposed "
            "(waited for after backward)|intra_node|inter_node (hops a hierarchical reduction "
            "times apart, every step; 0 where the reduction is one flat collective).",
            ["kind"],
            registry=r,
        )
        self.comm_bytes = Counter(
            "meshscope_comm_bytes_total",
            "Gradient bytes this rank sends: raw as a plain all-reduce would send them, wire as "
            "sent (raw / wire = the compression ratio), inter_node its share of what crossed "
            "the node boundary.",
            ["kind"],
            registry=r,
        )
        # loss and grad norm exist once a step logged them: absent, not NaN, when a loop never does
        self._scalars: dict[str, Gauge] = {}
        self._expert_work: Counter | None = None  # registered by the first expert-parallel window
        self.memory = Gauge(
            "meshscope_memory_bytes",
            "Memory; kind=allocated|reserved (device), rss (host).",
            ["kind"],
            registry=r,
        )

    def _layer_families(self, r: CollectorRegistry) -> None:
        """Per layer (bounded: layers, experts, modules), exported by rank 0."""
        # the gradient inspector's, exported by rank 0 (gradients are all-reduced: one answer)
        self.layer_grad_norm = Gauge(
            "meshscope_layer_grad_norm",
            "Gradient norm of one layer's parameters (sampled steps).",
            ["module"],
            registry=r,
        )
        self.layer_update_ratio = Gauge(
            "meshscope_layer_update_ratio",
            "Norm of one layer's last update over its weights' norm.",
            ["module"],
            registry=r,
        )
        # rank 0's expert families, made from two tables at scrape time (`ExpertTable`)
        self.experts = ExpertTable(r)

    def _fault_families(self, r: CollectorRegistry) -> None:
        """Liveness, faults, restarts and what the run is."""
        self.heartbeat_age = Gauge(
            "meshscope_heartbeat_age_seconds",
            "Seconds since a rank's last heartbeat (exported by its node's watcher).",
            ["peer"],
            registry=r,
        )
        self.faults = faults_counter(r)
        self.restarts = Counter("meshscope_restarts_total", "Elastic restarts of this job.", registry=r)
        self.recovery = Gauge(
            "meshscope_recovery_seconds", "Time of the last recovery, failure to first step.", registry=r
        )
        self.run_info = Info("meshscope_run", "What this run is.", registry=r)

    def _touch_known_children(self) -> None:
        """Create bounded label sets up front so every series exists from the first scrape."""
        self._children = {phase: self.step_phase.labels(phase=phase) for phase in PHASES}
        self._children["comm_total"] = self.comm_seconds.labels(kind="total")
        self._children["comm_exposed_total"] = self.comm_seconds.labels(kind="exposed")
        for kind in HOP_KINDS:
            self._children[f"comm_{kind}"] = self.comm_seconds.labels(kind=kind)
        for kind in ("raw", "wire", "inter_node"):
            self._children[f"bytes_{kind}"] = self.comm_bytes.labels(kind=kind)
        for kind in ("allocated", "reserved", "rss"):
            self._children[kind] = self.memory.labels(kind=kind)
        for kind in FAULT_KINDS:
            self.faults.labels(kind=kind)

    def describe_run(
        self, *, device: str, backend: str, world_size: int, compression: str, version: str
    ) -> None:
        """Set `meshscope_run_info` (what this run is)."""
        self.run_info.info(
            {
                "device": device,
                "backend": backend,
                "world_size": str(world_size),
                "compression": compression,
                "version": version,
            }
        )

    def observe_step(self, rec: StepRecord, comm_sample_every: int = 1) -> None:
        """Export one step (see `observe_steps`)."""
        self.observe_steps([rec], comm_sample_every)

    def _scalar(self, key: str) -> Gauge:
        """The gauge of a logged scalar (`loss`, `grad_norm`), registered on first use."""
        if key not in self._scalars:
            what = {"loss": "training loss", "grad_norm": "global gradient norm"}[key]
            self._scalars[key] = Gauge(f"meshscope_{key}", f"Last step's {what}.", registry=self._registry)
        return self._scalars[key]

    def observe_steps(
        self,
        recs: Sequence[StepRecord],
        comm_sample_every: int = 1,
        logged: Collection[str] = ("loss", "grad_norm"),
        detail_every: int = 1,
    ) -> None:
        """Export finished steps at once: every step into the histogram and the counters, the
        last one into the gauges (a scrape sees the latest either way). Time in flight is
        measured on one step in `comm_sample_every`: each measurement counts for the steps it
        stands for (an estimate; NaN = not measured); an estimate below the wait measured after
        backward is raised to it, since that wait is communication too (total >= exposed).
        `logged`: the scalars the loop logs (the others' gauges stay absent). The wait after
        backward and the phases are timed on one step in `detail_every` (NaN between): each
        timed wait counts for the steps it stands for, and the phase gauges show the last
        timed step."""
        if not recs:
            return
        c = self._children  # labelled children resolved once: this runs every window
        for rec in recs:
            self.step_duration.observe(rec.step_s)
        in_flight = sum(r.comm_total_s for r in recs if math.isfinite(r.comm_total_s))
        timed = [r for r in recs if not math.isnan(r.comm_exposed_s)]
        exposed = sum(r.comm_exposed_s for r in timed) * detail_every
        self.steps.inc(len(recs))
        self.tokens.inc(sum(r.tokens for r in recs))
        c["comm_total"].inc(max(in_flight * comm_sample_every, exposed))  # window by window
        c["comm_exposed_total"].inc(exposed)
        c["bytes_raw"].inc(sum(r.bytes_raw for r in recs))
        c["bytes_wire"].inc(sum(r.bytes_wire for r in recs))
        c["bytes_inter_node"].inc(sum(r.bytes_inter for r in recs))
        c["comm_intra_node"].inc(sum(r.comm_intra_s for r in recs if math.isfinite(r.comm_intra_s)))
        c["comm_inter_node"].inc(sum(r.comm_inter_s for r in recs if math.isfinite(r.comm_inter_s)))
        c["comm_expert_all_to_all"].inc(sum(r.comm_a2a_s for r in recs if math.isfinite(r.comm_a2a_s)))
        if timed:
            self._observe_phases(timed[-1])
        last = recs[-1]
        for key in ("loss", "grad_norm"):
            if key in logged:
                self._scalar(key).set(getattr(last, key))
        c["allocated"].set(last.mem_allocated)
        c["reserved"].set(last.mem_reserved)
        c["rss"].set(last.mem_rss)

    def _observe_phases(self, timed: StepRecord) -> None:
        """The phase gauges and the comm ratio, from a step whose phases were timed."""
        c = self._children
        c["forward"].set(timed.forward_s)
        c["backward"].set(timed.backward_s)
        c["optimizer"].set(timed.optimizer_s)
        c["comm_exposed"].set(timed.comm_exposed_s)
        c["data"].set(timed.data_s)
        self.comm_ratio.set(timed.comm_ratio)

    def observe_expert_work(self, tokens: Sequence[float]) -> None:
        """Export one window of the tokens this rank's experts processed, per layer (expert
        parallelism only: one series per MoE layer and rank)."""
        if self._expert_work is None:
            self._expert_work = Counter(
                "meshscope_expert_work_tokens_total",
                "Tokens the experts this rank holds processed (expert parallelism), by layer.",
                ["layer"],
                registry=self._registry,
            )
        for layer, count in enumerate(tokens):
            self._expert_work.labels(layer=str(layer)).inc(float(count))

    def observe_experts(self, windows: Sequence[Sequence[Sequence[float]]]) -> None:
        """Export windows of expert tokens, each `[layer][expert]` and already summed over
        ranks, oldest first: the token counters take them all, the load and imbalance gauges
        the latest (`ExpertTable`)."""
        self.experts.add(windows)


class ExpertTable(Collector):
    """Rank 0's expert families (tokens, load ratio, imbalance), made at scrape time from the
    tokens counted so far and the latest window. A batch of windows costs a few array sums on
    the service thread, whatever the model's size: as labelled series, a batch updated two
    series per (layer, expert), 5.6 ms a batch at 48 layers x 64 experts."""

    TOKENS = ("meshscope_expert_tokens", "Tokens routed to an expert, summed over ranks.")
    LOAD = (
        "meshscope_expert_load_ratio",
        "Expert's share of the layer's tokens times the number of experts (1 = balanced).",
    )
    IMBALANCE = ("meshscope_expert_imbalance_ratio", "Max / mean expert load of a layer.")

    def __init__(self, registry: CollectorRegistry) -> None:
        self._lock = threading.Lock()
        self._totals: np.ndarray | None = None  # tokens so far, [layer, expert]
        self._latest: np.ndarray | None = None  # the latest window's
        registry.register(self)

    def add(self, windows: Sequence[Sequence[Sequence[float]]]) -> None:
        """Count a batch of windows, oldest first; the latest becomes the gauges'."""
        if not windows:
            return
        tables = [np.asarray(w, dtype=float) for w in windows]
        batch = functools.reduce(_added, tables)
        with self._lock:  # new arrays, never changed after: a scrape reads a consistent pair
            self._totals = batch if self._totals is None else _added(self._totals, batch)
            self._latest = tables[-1]

    def describe(self) -> Iterator[Metric]:
        """The families, without samples (what registering checks names against)."""
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        """The families with a sample a (layer, expert) seen so far."""
        tokens, load, imbalance = self._families()
        with self._lock:
            totals, latest = self._totals, self._latest
        if totals is not None and latest is not None:
            for (layer, expert), count in np.ndenumerate(totals):
                tokens.add_metric([str(layer), str(expert)], float(count))
            row_totals = latest.sum(axis=1)
            experts = latest.shape[1]
            for layer, row in enumerate(latest):
                total = float(row_totals[layer])
                ratios = row / total * experts if total > 0 else np.zeros_like(row)
                for expert, ratio in enumerate(ratios):
                    load.add_metric([str(layer), str(expert)], float(ratio))
                if total > 0:
                    imbalance.add_metric([str(layer)], float(row.max() / (total / experts)))
        yield from (tokens, load, imbalance)

    def _families(self) -> tuple[CounterMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        """The three families, empty."""
        return (
            CounterMetricFamily(*self.TOKENS, labels=["layer", "expert"]),
            GaugeMetricFamily(*self.LOAD, labels=["layer", "expert"]),
            GaugeMetricFamily(*self.IMBALANCE, labels=["layer"]),
        )


def _added(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a + b, the smaller padded with zeros where their shapes differ (a model whose layers
    change size between windows)."""
    if a.shape == b.shape:
        return a + b
    shape = np.maximum(a.shape, b.shape)
    return sum(np.pad(t, [(0, want - have) for have, want in zip(t.shape, shape)]) for t in (a, b))


class DetectorMetrics:
    """What the detection engine beside a run exports (its own endpoint, job
    `meshscope_detector`): kept apart so per-rank queries never see a detector's series."""

    def __init__(self, registry: CollectorRegistry = REGISTRY, anomaly_types: tuple[str, ...] = ()) -> None:
        """`anomaly_types`: the types the engine's rules declare, counted from 0."""
        self.anomaly_score = Gauge(
            "meshscope_anomaly_score",
            "Latest anomaly score (higher = more anomalous).",
            ["detector"],
            registry=registry,
        )
        self.anomalies = Counter(
            "meshscope_anomalies_total", "Anomalies opened, by type.", ["type"], registry=registry
        )
        for kind in anomaly_types:  # from 0, so increase() sees the first anomaly
            self.anomalies.labels(type=kind)
        self.faults = faults_counter(registry)
        self.faults.labels(kind="hang")
