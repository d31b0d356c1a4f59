"""Efficiency factors fitted from meshscope's own run stores: what a job achieved against the
cluster's peaks, per part of the step, from its StepRecords (compute, optimizer, gradient
communication total and exposed, the expert all-to-all) and its expert load.

A run describes itself (config.json): the model, the batch, the ranks and `parallel.ep`, so
the model below predicts that very run at efficiency 1; the ratio to what was measured is
the factor. Medians over steps after a warm-up and robust fits across runs keep one slow
step or one odd run from moving a factor."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from pydantic import ValidationError

from meshscope.advisor.cost import Factors, backward_window, predict
from meshscope.advisor.layouts import Layout, layout_frame
from meshscope.advisor.specs import ClusterSpec, ModelSpec
from meshscope.collector.figures import with_compute
from meshscope.collector.rundir import run_config, world_size
from meshscope.collector.store import load_events, load_expert_load, load_steps

WARMUP = 0.2  # share of a run's first steps left out (allocation, caches, first buckets)
MIN_REL_ERROR = 0.05  # the interval never claims more than this machine's repeatability
HOLD_OUT_RUNS = 6  # runs needed before the interval is sized by leaving each out in turn
STATED_BANDWIDTH = "the cluster file's link bandwidth: the runs' sizes were too close to fit one"


class CalibrationError(ValueError):
    """A run that cannot calibrate the model (no store, no config, a compressed run); the text says which."""


@dataclass(frozen=True)
class MeasuredRun:
    """One run as the model sees it: its model and layout, and the medians it measured."""

    path: Path
    model: ModelSpec
    layout: Layout
    backend: str
    step_s: float  # per step, the slowest rank's
    compute_s: float  # forward + backward on the slowest rank (no optimizer, no wait)
    optimizer_s: float
    grad_total_s: float  # gradient communication, all of it
    grad_exposed_s: float  # the part the step waited for
    a2a_s: float  # the expert all-to-all (NaN without expert parallelism)
    expert_skew: float  # max/mean tokens per expert, median over layers and windows (1 when unknown)
    steps: int
    ranks_per_node: int = 1
    left_out: str = ""  # the steps a fault or an anomaly disturbed, said as a user reads it


def _section(config: dict, name: str) -> dict:
    value = config.get(name)
    return value if isinstance(value, dict) else {}


def run_model(config: dict, world: int, skew: float) -> tuple[ModelSpec, Layout]:
    """The ModelSpec and Layout of a run of meshscope's reference trainer, from its config."""
    model, train, parallel = (
        _section(config, "model"),
        _section(config, "train"),
        _section(config, "parallel"),
    )
    if not model or not train:
        raise CalibrationError(
            "its config.json has no [model] or [train] (a user's own loop): describe it with --model"
        )
    d, batch = int(model.get("d_model", 64)), int(train.get("batch_size", 8))
    dropless = parallel.get("dispatch") == "dropless"
    spec = ModelSpec(
        name="reference MoE",
        layers=int(model.get("layers", 2)),
        hidden=d,
        heads=int(model.get("heads", 4)),
        ffn_hidden=int(model.get("ffn_mult", 2)) * d,
        vocab=int(model.get("vocab_size", 128)),
        seq_len=int(model.get("seq_len", 32)),
        global_batch=batch * world,
        experts=int(model.get("experts", 4)),
        top_k=int(model.get("top_k", 2)),
        capacity_factor=1.0 if dropless else float(model.get("capacity_factor", 1.25)),
        dispatch="dropless" if dropless else "capacity",
        expert_skew=max(skew, 1.0),
        precision="fp32",
    )
    return spec, Layout(dp=world, ep=int(parallel.get("ep", 1)), mb=batch)


def _expert_skew(run: Path) -> float:
    """max/mean tokens per expert over the run's windows (1 when none were recorded)."""
    load = load_expert_load(run)
    if load.empty:
        return 1.0
    by = load.groupby(["step", "layer"]).tokens
    ratio = (by.max() / by.mean().replace(0, np.nan)).dropna()
    return float(ratio.median()) if len(ratio) else 1.0


def _backend(run: Path) -> str:
    """The backend the run's run_start names ('' when it names none)."""
    started = load_events(run, "run_start")
    return str(started.detail.iloc[0].get("backend", "")) if len(started) else ""


def measure(run: Path) -> MeasuredRun:
    """A run's layout and its per-part medians (CalibrationError when it cannot say them)."""
    config = run_config(run)
    if _section(config, "train").get("compression", "none") not in ("none", None):
        raise CalibrationError("its gradients were compressed; the model prices uncompressed reduction")
    try:
        steps = with_compute(load_steps(run))
    except (FileNotFoundError, pd.errors.DatabaseError, OSError) as err:
        raise CalibrationError(f"no readable run store ({err})") from None
    if steps.empty:
        raise CalibrationError("no steps recorded")
    world = (
        world_size(config) if config else int(steps["rank"].max()) + 1
    )  # a node's store holds its own ranks
    model, layout = run_model(config, world, _expert_skew(run))
    steps = steps[steps.step >= steps.step.min() + WARMUP * (steps.step.max() - steps.step.min())]
    disturbed, left_out = _disturbed_steps(run)
    if disturbed and not steps.step.isin(disturbed).all():
        steps = steps[~steps.step.isin(disturbed)]
    a2a = steps.comm_a2a_s.fillna(0.0) if "comm_a2a_s" in steps else steps.step_s * 0
    steps = steps.assign(
        busy_s=steps.compute_s - steps.optimizer_s,
        grad_total_s=steps.comm_total_s - a2a,
        grad_exposed_s=(steps.comm_exposed_s - a2a).clip(lower=0),
        a2a_s=a2a,
    )
    per_rank = steps.groupby("rank").median(numeric_only=True)
    slowest = per_rank.busy_s.idxmax()
    return MeasuredRun(
        path=run,
        model=model,
        layout=layout,
        backend=_backend(run),
        step_s=float(steps.groupby("step").step_s.max().median()),
        compute_s=float(per_rank.busy_s.max()),
        optimizer_s=float(per_rank.optimizer_s.median()),
        grad_total_s=float(per_rank.grad_total_s.median()),
        grad_exposed_s=float(per_rank.grad_exposed_s.median()),
        a2a_s=float(per_rank.a2a_s.loc[slowest]) if layout.ep > 1 else float("nan"),
        expert_skew=model.expert_skew,
        steps=int(steps.step.nunique()),
        ranks_per_node=int(config.get("nproc", world)),
        left_out=left_out,
    )


def _disturbed_steps(run: Path) -> tuple[set[int], str]:
    """The steps a fault was injected into or an anomaly covered, and how to say so: a 3×
    straggler is no efficiency of the machine, and the cost model must not learn it as one."""
    try:
        events = load_events(run)
    except (FileNotFoundError, pd.errors.DatabaseError, OSError):
        return set(), ""
    out: set[int] = set()
    said = []
    for _, e in events[events["kind"].isin(("injected", "anomaly"))].iterrows():
        d = e["detail"]
        lo = d.get("start_step", e["step"])
        if lo is None or pd.isna(lo):
            continue
        hi = d.get("end_step", int(lo) + int(d.get("steps", 1)) - 1)
        out |= set(range(int(lo), int(hi) + 1))
        what = f"injected {d.get('kind')}" if e["kind"] == "injected" else f"anomaly {d.get('type')}"
        said.append(f"{what} (steps {int(lo)}–{int(hi)})")
    return out, ("left out " + ", ".join(dict.fromkeys(said))) if said else ""


def _ideal(run: MeasuredRun, cluster: ClusterSpec, latency: float = 1.0) -> pd.Series:
    """The run predicted with every efficiency at 1, nothing hidden and no overhead (and the
    per-hop latency scaled by `latency`: 0 leaves the bandwidth term alone)."""
    ideal = Factors(
        compute_efficiency=1,
        memory_efficiency=1,
        allreduce_efficiency=1,
        alltoall_efficiency=1,
        p2p_efficiency=1,
        dp_overlap=0,
        a2a_overlap=0,
        tp_overlap=0,
        cp_overlap=0,
        latency_scale=latency,
    )
    return predict(layout_frame([run.layout], run.model), run.model, cluster, ideal).iloc[0]


def _fit_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(intercept >= 0, slope > 0) of y against x, robust to one odd run (Theil-Sen slope,
    median intercept); a line through the origin when the runs do not spread x."""
    if len(x) < 2 or np.ptp(x) < 0.2 * np.max(x):
        return 0.0, float(np.median(y / x))
    i, j = np.triu_indices(len(x), 1)
    ok = x[j] != x[i]
    slope = float(np.median((y[j] - y[i])[ok] / (x[j] - x[i])[ok]))
    if slope <= 0:
        return 0.0, float(np.median(y / x))
    return max(float(np.median(y - slope * x)), 0.0), slope


@dataclass
class Calibration:
    """The fitted factors, the runs behind them and the runs left out (with why)."""

    factors: Factors
    runs: list[MeasuredRun] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    errors: list[float] = field(default_factory=list)  # each run's step-time error, fitted without it
    notes: list[str] = field(default_factory=list)


def _ratios(runs: list[MeasuredRun], ideals: list[pd.Series], measured: str, ideal: str) -> np.ndarray:
    pairs = [(float(p[ideal]), getattr(r, measured)) for r, p in zip(runs, ideals, strict=True)]
    return np.array([(i, m) for i, m in pairs if i > 0 and np.isfinite(m) and m > 0]).reshape(-1, 2)


def _compute(runs: list[MeasuredRun], cluster: ClusterSpec) -> dict[str, float]:
    """Compute efficiency and the per-step cost from the data-parallel runs (a line over their
    batch sizes), how much slower expert-parallel runs compute (their token permutation), and
    how much slower dropless dispatch computes than capacity dispatch (tokens grouped per
    expert), each from the runs that have it."""
    padded = _capacity_runs(runs)
    plain = _plain_runs(runs)
    xy = _ratios(plain, [_ideal(r, cluster) for r in plain], "compute_s", "compute_s")
    if not len(xy):
        return {}
    overhead, slope = _fit_line(xy[:, 0], xy[:, 1])
    out = {"step_overhead_s": overhead, "compute_efficiency": 1 / slope}

    line = (overhead, slope, cluster)
    if expert := [r for r in padded if r.layout.ep > 1 and r not in plain]:
        out["ep_compute_scale"] = _slower(expert, *line, ep_scale=1.0)
    if dropless := [r for r in runs if r.model.dispatch == "dropless" and r not in plain]:
        out["dropless_compute_scale"] = _slower(dropless, *line, ep_scale=out.get("ep_compute_scale", 1.0))
    return out


def _plain_runs(runs: list[MeasuredRun]) -> list[MeasuredRun]:
    """The data-parallel capacity-dispatch runs, which the efficiencies are fitted from (the
    capacity runs when there are none): what expert parallelism adds is priced on top."""
    padded = _capacity_runs(runs)
    return [r for r in padded if r.layout.ep == 1] or padded


def _capacity_runs(runs: list[MeasuredRun]) -> list[MeasuredRun]:
    """The capacity-dispatch runs, which the shared factors are fitted from (all runs when
    there are none): dropless dispatch only prices its own compute."""
    return [r for r in runs if r.model.dispatch == "capacity"] or runs


def _slower(
    runs: list[MeasuredRun], overhead: float, slope: float, cluster: ClusterSpec, ep_scale: float
) -> float:
    """How many times the compute the line predicts `runs` took (median; the line's per-step
    cost aside, expert-parallel runs' known slowdown `ep_scale` taken out)."""
    return float(
        np.median(
            [
                (r.compute_s - overhead)
                / (_ideal(r, cluster).compute_s * slope * (ep_scale if r.layout.ep > 1 else 1.0))
                for r in runs
            ]
        )
    )


def _allreduce(
    runs: list[MeasuredRun], cluster: ClusterSpec, compute_efficiency: float
) -> tuple[dict[str, float], dict[str, str]]:
    """All-reduce efficiency, a fixed cost per step's reduction and how much of it backward
    hides, from the time each step waited for it (and which of them the runs could only
    assume, with what on). Not from its whole span: an overlapped
    reduction's span measures contention with backward as much as the link (on CPU ranks it
    stretches with the batch). Runs that reduced the same bytes behind different backward
    windows give the hiding rate (the slope of waited time against window, median of the
    pairs); the waited time plus what was hidden, against the bytes, gives the rest (a line
    when the runs reduced different sizes)."""
    bandwidth = np.array([_ideal(r, cluster, 0.0).grad_sync_s for r in runs])
    stated = np.array([_ideal(r, cluster).grad_sync_s for r in runs]) - bandwidth
    compute = np.array([_ideal(r, cluster).compute_s for r in runs]) / compute_efficiency
    window = backward_window(compute, np.array([_ideal(r, cluster).m for r in runs]))
    waited = np.array([r.grad_exposed_s for r in runs]) - stated
    slopes = [
        (waited[i] - waited[j]) / (window[j] - window[i])
        for i in range(len(runs))
        for j in range(i + 1, len(runs))
        if np.isclose(bandwidth[i], bandwidth[j])
        and abs(window[j] - window[i]) > 0.1 * max(window[i], window[j])
    ]
    rate = float(np.clip(np.median(slopes), 0.0, 1.0)) if slopes else 0.0
    call_s, slope, sloped = _steadiest_line(bandwidth, waited + rate * window)
    out = {"allreduce_call_s": call_s, "allreduce_efficiency": 1 / slope, "dp_overlap": rate}
    return out, {} if sloped else {"allreduce_efficiency": STATED_BANDWIDTH}


def _steadiest_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float, bool]:
    """`_fit_line` (and True), unless a fixed cost at the stated bandwidth (slope 1, False)
    fits the runs better: when the runs' sizes differ by little, a slope over them is noise (on
    this machine a few tenths of a ms between runs that reduced 25 % more bytes read as a link
    28 times slower than stated)."""
    line = _fit_line(x, y)
    fixed = (max(float(np.median(y - x)), 0.0), 1.0)

    def misfit(fit: tuple[float, float]) -> float:
        return float(np.median(np.abs(fit[0] + fit[1] * x - y)))

    # a tie (one run: both go through it) is the line's; rounding must not decide it
    tie = 1e-9 * float(np.max(np.abs(y)))
    return (*line, True) if misfit(line) <= misfit(fixed) + tie else (*fixed, False)


def _alltoall(runs: list[MeasuredRun], cluster: ClusterSpec) -> dict[str, float]:
    """All-to-all efficiency and fixed cost per call, from the time per call against the ideal
    bandwidth term per call (a line when the runs sent different sizes, else the ratio)."""
    if not runs:
        return {}
    bandwidth = np.array([_ideal(r, cluster, 0.0).a2a_s for r in runs])
    stated = np.array([_ideal(r, cluster).a2a_s for r in runs]) - bandwidth  # the link's own latency
    calls = np.array([_ideal(r, cluster).a2a_calls for r in runs])
    x, y = bandwidth / calls, (np.array([r.a2a_s for r in runs]) - stated) / calls
    call_s, slope = _fit_line(x, y)
    return {"a2a_call_s": call_s, "alltoall_efficiency": 1 / slope}


def _names(runs: list[MeasuredRun]) -> str:
    return ", ".join(sorted({r.path.name for r in runs}))


def full_nodes(runs: list[MeasuredRun], cluster: ClusterSpec) -> list[MeasuredRun]:
    """The runs whose nodes were as full as the cluster's (every layout the advisor ranks fills
    its nodes); all of them when none was. Ranks sharing a host slow each other (memory
    bandwidth, the host's CPU, input), so a half-empty node computes faster than a full one."""
    full = [r for r in runs if r.ranks_per_node >= cluster.devices_per_node]
    return full or runs


def fit(runs: list[MeasuredRun], cluster: ClusterSpec) -> Factors:
    """Factors fitted from `runs` (measured on `cluster`); unfitted ones stay defaults, and
    each fitted one names the runs it came from."""
    values: dict[str, float] = {}
    measured: dict[str, str] = {}
    busy = full_nodes(runs, cluster)
    fitted = _compute(busy, cluster)
    values.update(fitted)
    measured.update(dict.fromkeys(fitted, _names(busy)))
    # expert-parallel ranks step fewer parameters yet spend longer in their optimizer phase
    # (more parameter groups, the expert group's bookkeeping): that is their fixed cost
    # (`_fitted`), not a slower memory
    plain = _plain_runs(busy)
    if len(xy := _ratios(plain, [_ideal(r, cluster) for r in plain], "optimizer_s", "other_s")):
        values["memory_efficiency"] = float(np.median(xy[:, 0] / xy[:, 1]))
        measured["memory_efficiency"] = _names(plain)
    # a dropless run's longer backward is its per-expert loop, not a window the reduction
    # hides behind the same way
    reduced = [r for r in _capacity_runs(runs) if r.layout.dp > 1 and r.grad_exposed_s > 0]
    assumed: dict[str, str] = {}
    if reduced:
        efficiency = values.get("compute_efficiency", Factors().compute_efficiency)
        fitted, assumed = _allreduce(reduced, cluster, efficiency)
        values.update(fitted)
        measured.update(dict.fromkeys(set(fitted) - set(assumed), _names(reduced)))
    exchanged = [r for r in runs if r.layout.ep > 1 and np.isfinite(r.a2a_s)]
    if a2a := _alltoall(exchanged, cluster):
        values.update(a2a)
        measured.update(dict.fromkeys(a2a, _names(exchanged)))
    factors = _within_bounds(values, measured)
    factors.assumed = {k: v for k, v in assumed.items() if k not in factors.rejected}
    return factors


def _within_bounds(values: dict[str, float], measured: dict[str, str]) -> Factors:
    """The factors, a fitted value outside its field's bounds left at its default (the runs
    could not pin it down): a calibration never fails on what it measured."""
    rejected = {}
    for name in list(values):
        try:
            Factors(**{name: values[name]})
        except ValidationError:
            rejected[name] = f"the runs gave {values.pop(name):.3g}, outside its bounds"
            measured.pop(name, None)
    return Factors(**values, measured=measured, rejected=rejected)


def calibrate(paths: list[Path], cluster: ClusterSpec) -> Calibration:
    """Measure each run, keep those on the cluster's backend, fit, and score the fit on them."""
    kept, skipped = [], {}
    for path in paths:
        try:
            run = measure(Path(path))
        except CalibrationError as err:
            skipped[str(path)] = str(err)
            continue
        if run.backend and run.backend != cluster.backend:
            skipped[str(path)] = f"ran on {run.backend}, the cluster file says {cluster.backend}"
            continue
        kept.append(run)
    if not kept:
        return Calibration(Factors(), [], skipped)
    factors = _fitted(kept, cluster)
    busy = full_nodes(kept, cluster)
    notes = [
        f"{r.path.name}: {r.ranks_per_node} of {cluster.devices_per_node} devices per node: "
        "its communication is used, not its compute"
        for r in kept
        if r not in busy
    ] + [f"{r.path.name}: {r.left_out}" for r in kept if r.left_out]
    errors = _held_out_errors(busy, cluster) if len(busy) >= HOLD_OUT_RUNS else []
    if errors:
        factors.rel_error = max(float(np.quantile(np.abs(errors), 0.9)), MIN_REL_ERROR)
    else:  # too few runs to spare one (each line needs two): twice the error on the runs themselves
        factors.rel_error = max(
            2 * max(abs(prediction_error(r, cluster, factors)) for r in busy), MIN_REL_ERROR
        )
    factors.measured["rel_error"] = _names(busy)
    return Calibration(factors, kept, skipped, errors, notes)


def _fitted(runs: list[MeasuredRun], cluster: ClusterSpec) -> Factors:
    """`fit`, then the per-step work no part names (input, bookkeeping) as overhead: the
    data-parallel runs' for every layout, and what the expert-parallel runs carry beyond it
    for theirs (pooled, one class's fixed cost leaks into the other's predictions)."""
    factors = fit(runs, cluster)
    busy = full_nodes(runs, cluster)
    plain = _plain_runs(busy)
    if (base := _residual(plain, cluster, factors)) > 0:
        factors.step_overhead_s += base
        factors.measured["step_overhead_s"] = _names(plain)
    expert = [r for r in busy if r.layout.ep > 1 and r not in plain]
    if expert and (extra := _residual(expert, cluster, factors)) > 0:
        factors.ep_step_overhead_s = extra
        factors.measured["ep_step_overhead_s"] = _names(expert)
    return factors


def _residual(runs: list[MeasuredRun], cluster: ClusterSpec, factors: Factors) -> float:
    """The median step time the runs took beyond what `factors` predict."""
    return float(np.median([r.step_s - predict_run(r, cluster, factors).step_s for r in runs]))


def _held_out_errors(runs: list[MeasuredRun], cluster: ClusterSpec) -> list[float]:
    """Each run's step-time error when the model is fitted on the others (leave one out): what
    the interval is sized from, since a run's error on a fit that saw it flatters the model."""
    return [
        prediction_error(run, cluster, _fitted(runs[:i] + runs[i + 1 :], cluster))
        for i, run in enumerate(runs)
    ]


def predict_run(run: MeasuredRun, cluster: ClusterSpec, factors: Factors) -> pd.Series:
    """The model's prediction of a measured run's layout (with the run's own skew)."""
    return predict(layout_frame([run.layout], run.model), run.model, cluster, factors).iloc[0]


def prediction_error(run: MeasuredRun, cluster: ClusterSpec, factors: Factors) -> float:
    """(predicted - measured) / measured step time."""
    return float(predict_run(run, cluster, factors).step_s / run.step_s - 1)
