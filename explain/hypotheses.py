"""The hypotheses of root cause: each is one small function over the facts of one window of
steps that answers with `Cause`s or nothing, in the terms of the person who has to act: a slow
host, a slow link, a hang and its call site, the first non-finite module, routing, a leak, a
crash, recovery that keeps failing. `HYPOTHESES` lists them; a new one is a function added there."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

from meshscope.collector.figures import STALL_FLOOR_S, balancedness, stall_threshold_s, with_compute
from meshscope.collector.schema import nonfinite_mask
from meshscope.collector.stacks import own_frame
from meshscope.detectors.pauses import PAUSES
from meshscope.explain.experts import hot_experts
from meshscope.explain.facts import (
    BASELINE_STEPS,
    LEAK_MIN_BYTES,
    LINK_RISE,
    SLOW_RATIO,
    Cause,
    RunFacts,
    Window,
    _pivot,
    _span,
    _step_time_rise,
    _top_k,
    _who,
)
from meshscope.explain.slow import slow_host


def _hang_events(facts: RunFacts, w: Window) -> list[Cause]:
    """The watchdog's own diagnosis: the culprit, the collective, the call site."""
    out = []
    hangs = facts.events[facts.events["kind"] == "hang"]
    for _, row in hangs.iterrows():
        d, step = row["detail"], row["step"]
        if d.get("type") == "dead":  # a death, not a hang: _crash reads it
            continue
        if step is not None and not pd.isna(step) and not (w.lo - 5 <= step <= w.hi + 5):
            continue
        culprits = [int(r) for r in d.get("culprit_ranks") or []]
        stack = (d.get("stacks") or {}).get(str(culprits[0])) if culprits else None
        evidence = [d.get("why", "")]
        if d.get("op"):
            evidence.append(f"collective: {d['op']} #{d.get('seq')} on group {d.get('group')}")
        if stack:
            evidence.append(f"rank {culprits[0]} was at {own_frame(stack)}")
        if d.get("waiting_ranks"):
            evidence.append(f"{_who(d['waiting_ranks'])} waited in the collective")
        if d.get("action") == "abort":
            evidence.append("the watchdog aborted the job's workers on purpose so it could resume")
        out.append(
            Cause(
                "hang",
                f"{_who(culprits)}: {d.get('type', 'hang')} at "
                + (f"{d['op']} #{d.get('seq')}" if d.get("op") else "a collective"),
                0.97,
                culprits,
                None if pd.isna(step) else int(step),
                [e for e in evidence if e],
                f"`meshscope hang-report --run {facts.run_dir}` shows every rank's stack; fix the "
                "call site above so every rank issues the same collectives in the same order",
            )
        )
    return out


def _stall(facts: RunFacts, w: Window) -> list[Cause]:
    """One step where some ranks waited seconds in a collective for ranks that did not."""
    steps = facts.steps
    if steps.empty or steps["rank"].nunique() < 2:
        return []
    typical = float(steps["step_s"].median())
    wait = _pivot(w.of(steps), "comm_exposed_s")
    compute = _pivot(with_compute(w.of(steps)), "compute_s")
    out = []
    for step, row in wait.iterrows():
        longest = float(row.max())
        if longest < stall_threshold_s(typical, floor_s=STALL_FLOOR_S):
            continue
        culprits = [int(r) for r, v in row.items() if v < 0.25 * longest]
        if not culprits:
            continue
        waiting = [int(r) for r in row.index if int(r) not in culprits]
        inside = all(compute.loc[step, r] >= 0.5 * longest for r in culprits)
        where = (
            "in its own compute"
            if inside
            else "outside the timed step (between steps: a sleep, the host, data, a lock)"
        )
        out.append(
            Cause(
                "hang",
                f"{_who(culprits)} stalled {longest:.1f} s at step {step}",
                0.9,
                culprits,
                int(step),
                [
                    f"{_who(waiting)} waited {longest:.2f} s in communication at step {step} "
                    f"(a typical step takes {typical:.3f} s)",
                    f"{_who(culprits)} did not wait: the time went {where}",
                ],
                f"if it recurs, run with `--on-hang abort` (or `report`) to get the stalled rank's "
                f"stack; py-spy dump --pid <rank {culprits[0]}'s pid> shows it now",
            )
        )
    return out[:1]


def _slow_link(facts: RunFacts, w: Window) -> list[Cause]:
    """Exposed communication up on every rank, compute flat: the link, not a rank."""
    win, base = w.of(facts.steps), w.before(facts.steps)
    if win.empty or base.empty:
        return []
    floor = 1e-3  # a millisecond: below it, ratios of noise
    comm_win = win.groupby("rank")["comm_exposed_s"].median()
    comm_base = base.groupby("rank")["comm_exposed_s"].median().clip(lower=floor)
    rise = (comm_win / comm_base).dropna()
    if rise.empty or float(rise.min()) < LINK_RISE:
        return []
    cwin = with_compute(win).groupby("rank")["compute_s"].median()
    cbase = with_compute(base).groupby("rank")["compute_s"].median()
    # The step grew by communication more than by compute on every rank, and no rank computes
    # much slower than the others (that would be a slow host making its peers wait).
    comm_growth = float((comm_win - comm_base).min())
    compute_growth = float((cwin - cbase).max())
    if comm_growth <= compute_growth or float(cwin.max() / max(cwin.min(), 1e-9)) >= SLOW_RATIO:
        return []
    compute_rise = float((cwin / cbase.clip(lower=floor)).max())
    evidence = [
        f"exposed communication rose {rise.min():.0f}–{rise.max():.0f}× on every rank "
        f"({comm_base.median():.3f} → {comm_win.median():.3f} s per step) over "
        f"{_span(w.lo, w.hi)}",
        f"compute stayed within {compute_rise:.1f}× of its usual on every rank",
    ]
    wire_win, wire_base = win["bytes_wire"].median(), base["bytes_wire"].median()
    if wire_base > 0 and wire_win <= 1.1 * wire_base:
        evidence.append(
            f"the same bytes on the wire ({wire_win / 2**20:.1f} MiB per step): the "
            "link got slower, the traffic did not grow"
        )
    return [
        Cause(
            "slow_link",
            f"communication {rise.min():.0f}× slower on every rank, compute unchanged",
            min(0.9, 0.5 + 0.05 * float(rise.min())),
            sorted(int(r) for r in rise.index),
            w.lo,
            evidence,
            "check the interconnect between these ranks' hosts: NCCL_DEBUG=INFO / HCCL logs for "
            "retries, nccl-tests or hccl_test for bandwidth, link errors on the NICs; gradient "
            "compression (fp16, powersgd) lowers the bytes in the meantime",
        )
    ]


def _routing(facts: RunFacts, w: Window) -> list[Cause]:
    """A layer whose routing concentrates on few experts, compared with before."""
    ex = facts.experts
    if ex.empty:
        return []
    every = int(ex["step"].drop_duplicates().diff().median()) if ex["step"].nunique() > 1 else 1
    win = ex[(ex["step"] >= w.lo) & (ex["step"] <= w.hi + every)]
    base = ex[(ex["step"] < w.lo) & (ex["step"] >= w.lo - BASELINE_STEPS - every)]
    if win.empty:
        return []
    top_k = _top_k(facts, every)
    best: Cause | None = None
    for layer, rows in win.groupby("layer"):
        by_step = rows.pivot_table(index="step", columns="expert", values="tokens")
        bal = by_step.apply(lambda r: balancedness(r.to_numpy()), axis=1)
        usual = 1.0
        if not base.empty:
            b = base[base["layer"] == layer].pivot_table(index="step", columns="expert", values="tokens")
            usual = (
                float(b.apply(lambda r: balancedness(r.to_numpy()), axis=1).median()) if not b.empty else 1.0
            )
        worst_step = bal.idxmin()
        drop = usual - float(bal.min())
        if drop < 0.15 or float(bal.min()) > 0.8 * usual:
            continue
        counts = by_step.loc[worst_step]
        share = counts / counts.sum()
        hog, n = int(share.idxmax()), len(share)
        confidence = min(0.93, 0.6 + 0.5 * drop)
        evidence = [
            f"layer {layer}: balancedness (mean/max load) {usual:.2f} → {bal.min():.2f} at step {worst_step}",
            f"expert {hog} took {share[hog]:.2f} of the routed tokens (balanced "
            f"{1 / n:.2f}, at most {1 / top_k:.2f} with top-{top_k})",
        ]
        starving = [int(e) for e, s in share.items() if s < 0.25 / n]
        if starving:
            evidence.append(f"starving: expert(s) {', '.join(map(str, starving))}")
        if turned := _starved_after(by_step, hog, worst_step, 0.25 / n):
            evidence.append(f"then expert {hog} starved: {turned[1]:.0%} of its tokens from step {turned[0]}")
        slow = _step_time_rise(facts, w)
        if slow >= 1.2:
            evidence.append(f"step time rose {slow:.1f}× over the same steps")
        cause = Cause(
            "routing",
            f"layer {layer}'s router sends {share[hog]:.0%} of tokens to expert {hog}"
            + (f", then starves it from step {turned[0]}" if turned else ""),
            confidence,
            [],
            int(worst_step),
            evidence,
            f"correct layer {layer}'s router bias: `meshscope feedback ingest LOAD --run "
            f"{facts.run_dir}` ranks corrections and `meshscope feedback apply --run {facts.run_dir} "
            "--suggestion ID` applies one while it trains; or raise the aux-loss coefficient "
            "(`meshscope run --set model.aux_loss_coef=0.05`)",
        )
        if best is None or cause.confidence > best.confidence:
            best = cause
    return [best] if best else []


def _starved_after(by_step: pd.DataFrame, expert: int, after: int, floor: float) -> tuple[int, float] | None:
    """(first step, least share) where `expert`, after hogging at step `after`, got under
    `floor` of its layer's tokens: a collapse that turns (the router overcorrects)."""
    later = by_step.loc[by_step.index > after]
    if later.empty or expert not in later:
        return None
    share = later[expert] / later.sum(axis=1).clip(lower=1e-9)
    under = share[share < floor]
    return (int(under.index[0]), float(share.min())) if not under.empty else None


def _leak(facts: RunFacts, w: Window) -> list[Cause]:
    """One rank's memory rising steadily while its peers' does not."""
    steps = facts.steps[(facts.steps["step"] >= w.lo - 5) & (facts.steps["step"] <= w.hi)]
    if steps["step"].nunique() < 5:
        return []
    growth: dict[int, tuple[float, float, str]] = {}
    for rank, rows in steps.groupby("rank"):
        column = (
            "mem_allocated"
            if rows["mem_allocated"].max() > 0 and rows["mem_allocated"].std() > rows["mem_rss"].std()
            else "mem_rss"
        )
        x, y = rows["step"].to_numpy(float), rows[column].to_numpy(float)
        slope, intercept = np.polyfit(x, y, 1)
        resid = y - (slope * x + intercept)
        r2 = 1 - resid.var() / max(y.var(), 1e-9)
        growth[int(rank)] = (slope * (x.max() - x.min()), r2, column)
    rank = max(growth, key=lambda r: growth[r][0])
    grown, r2, column = growth[rank]
    others = [g for r, (g, _, _) in growth.items() if r != rank]
    peers = max(others, default=0.0)
    if grown < LEAK_MIN_BYTES or r2 < 0.7 or (others and peers > 0.3 * grown):
        return []
    span = steps["step"].max() - steps["step"].min()
    what = "device memory" if column == "mem_allocated" else "host memory (RSS)"
    return [
        Cause(
            "leak",
            f"rank {rank}'s {what} grows {grown / span / 2**20:.1f} MiB per step",
            min(0.9, 0.55 + 0.35 * r2),
            [rank],
            w.lo,
            [
                f"rank {rank}: +{grown / 2**20:.0f} MiB over {_span(int(steps['step'].min()), w.hi)}, "
                f"steadily (linear fit r² {r2:.2f})",
                f"its peers: +{max(peers, 0) / 2**20:.0f} MiB at most",
            ],
            f"look for what rank {rank} keeps across steps (a loss kept with its graph, a growing "
            "list or cache); tracemalloc or torch.cuda.memory._record_memory_history on that rank "
            "names the allocation",
        )
    ]


def _nonfinite(facts: RunFacts, w: Window) -> list[Cause]:
    """The first NaN/Inf: the tracer's module when it localised one, else the loss."""
    ev = facts.events[(facts.events["kind"] == "nan")]
    ev = ev[(ev["step"] >= w.lo - 1) & (ev["step"] <= w.hi + 1)]
    if ev.empty:
        return _nonfinite_from_steps(facts, w)
    first = ev.sort_values(["step", "id"]).iloc[0]
    at_first = ev[ev["step"] == first["step"]]
    with_module = _rows(at_first, [bool(d.get("module")) for d in at_first["detail"]])
    row = with_module.iloc[0] if len(with_module) else first
    d, step = row["detail"], int(row["step"])
    # the ranks that placed it: a peer that only saw the NaN arrive names no module
    ranks = sorted({int(r) for r in (with_module if len(with_module) else at_first)["rank"].dropna()})
    snaps = facts.events[(facts.events["kind"] == "snapshot") & (facts.events["step"] == step)]
    if d.get("module"):
        experts = d.get("experts") or []
        where = d["module"] + (f" (expert {', '.join(map(str, experts))})" if experts else "")
        title = f"first non-finite value: {where} ({d.get('where', '?')}) at step {step}"
        evidence = [
            f"{d.get('tensor', 'output')} of {where} ({d.get('class', '')}) on "
            f"{_who(ranks)}, the first module in execution order"
        ]
        if d.get("note") and d["note"] != "repeat":  # how it was placed (a re-run, weights, exchanges)
            evidence.append(d["note"])
    else:
        what, value = d.get("what", "loss"), d.get("value")
        title = f"{what} became {value or 'non-finite'} at step {step}"
        why = d.get("note") or "no module was localised (tracer off?)"
        evidence = [f"{what} {'= ' + str(value) if value else 'non-finite'} on {_who(ranks)}; {why}"]
        if len(ranks) > 1 and len(ranks) == facts.steps["rank"].nunique():
            ranks = []  # every rank, unlocalised: no culprit among them
    action = "rerun with `--trace nonfinite` (the default) to name the module and snapshot it"
    if "expert parallelism" in d.get("note", ""):
        action = "rerun with `--set parallel.ep=1` and the same seed to name the module"
    if d.get("tensor") == "parameter" and "own weights" in d.get("note", ""):
        action = (
            f"its weights were already non-finite: resume from a checkpoint before step {step} and "
            "look at the update that wrote them (learning rate, loss scaling, gradient clipping)"
        )
    if len(snaps):
        path = snaps.iloc[0]["detail"].get("path")
        evidence.append(f"snapshot: {path}")
        action = f"`meshscope replay {path}` re-runs the module on the saved inputs"
    return [Cause("nonfinite", title, 0.95 if d.get("module") else 0.88, ranks, step, evidence, action)]


def _nonfinite_from_steps(facts: RunFacts, w: Window) -> list[Cause]:
    win = w.of(facts.steps)
    bad = win[nonfinite_mask(win, "loss")] if len(win) else win
    if bad.empty:
        return []
    step = int(bad["step"].min())
    ranks = sorted(int(r) for r in bad[bad["step"] == step]["rank"])
    return [
        Cause(
            "nonfinite",
            f"loss became non-finite at step {step}",
            0.8,
            ranks,
            step,
            [f"loss non-finite on {_who(ranks)} at step {step}"],
            "rerun with `--trace nonfinite` to name the first module and snapshot it",
        )
    ]


def _checkpoint(facts: RunFacts, w: Window) -> list[Cause]:
    """Checkpoints saved in (or just before) the window: meshscope's own pause, a known cause,
    as sure as the share of the window's extra time it accounts for (the steps a save slows,
    `detectors.pauses`). A straggler whose window holds a save stays a straggler."""
    ev = facts.events
    saves = ev[(ev["kind"] == "checkpoint") & ev["step"].between(w.lo - 1, w.hi)] if not ev.empty else ev
    saves = _rows(saves, ["held_s" in d for d in saves["detail"]]) if "detail" in saves else saves
    if saves.empty:
        return []
    share = checkpoint_share(facts, w, {int(s) + d for s in saves["step"] for d in PAUSES["checkpoint"]})
    row = max(saves.itertuples(), key=lambda r: r.detail["held_s"])
    held, step = float(row.detail["held_s"]), int(row.step)
    background = all(d.get("async") for d in saves["detail"])
    mode = "in the background (staging only)" if background else "in the foreground"
    action = "expected, not a fault" + (
        "; saving already runs in the background: a larger elastic.checkpoint_every saves less often"
        if background
        else "; if it is too long: --set elastic.async_checkpoint=true, or a larger elastic.checkpoint_every"
    )
    return [
        Cause(
            "checkpoint",
            f"the checkpoint of step {step}: {share:.0%} of the extra time in {_span(w.lo, w.hi)}",
            0.9 * share,
            [],
            step,
            [
                f"meshscope saved a checkpoint at step {step} {mode}; it held the job {held:.2f} s "
                "and slows the step after it"
            ],
            action,
        )
    ]


def checkpoint_share(facts: RunFacts, w: Window, slowed: set[int]) -> float:
    """The share of the window's extra job time (its slowest rank's step over the median step
    before it) that the checkpoint's steps add: what they took beyond the window's other steps
    (a straggler's steps are slow with or without a save in them)."""
    job = facts.steps.groupby("step")["step_s"].max()
    before = job[(job.index < w.lo) & (job.index >= w.lo - BASELINE_STEPS)]
    base = float(before.median()) if not before.empty else float(job.median())
    window = job[(job.index >= w.lo) & (job.index <= w.hi)]
    total = float((window - base).clip(lower=0).sum())
    if total <= 0:
        return 0.0
    rest = window[~window.index.isin(slowed)]
    usual = max(base, float(rest.median())) if not rest.empty else base
    added = float((window[window.index.isin(slowed)] - usual).clip(lower=0).sum())
    return min(1.0, added / total)


def _events_where(ev: pd.DataFrame, kind: str, key: str, value: Any) -> pd.DataFrame:
    """Events of `kind` whose detail has `key` == `value`."""
    rows = ev[ev["kind"] == kind]
    return _rows(rows, [d.get(key) == value for d in rows["detail"]])


def _rows(frame: pd.DataFrame, keep: list[bool]) -> pd.DataFrame:
    """The rows of `frame` where `keep` holds. `frame[[]]` would select no columns, so an
    empty selection would lose them all (and the next `["detail"]` fail)."""
    return frame.loc[np.asarray(keep, dtype=bool)]


def _deaths(ev: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Deaths as the next attempt reports them (faults), and as the watchdog saw them happen.
    The last death of a job that gave up has no next attempt: only the watchdog saw it."""
    return _events_where(ev, "fault", "type", "dead_rank"), _events_where(ev, "hang", "type", "dead")


def _outlived(facts: RunFacts, deaths: pd.DataFrame) -> pd.DataFrame:
    """The death reports their rank outlived in the same attempt: it recorded a step after the
    report, or the job ended cleanly after it (the last barrier needs every rank) with no
    restart between. A heartbeat late on a busy host, not a death: naming the rank would be
    a wrong culprit."""
    ev, steps = facts.events, facts.steps
    restarts = ev.loc[ev["kind"].isin(["restart", "resume"]), "time"]
    ends = ev.loc[ev["kind"] == "run_end", "time"]

    def outlived(row: Any) -> bool:
        at = row["time"]
        until = restarts[restarts > at].min() if (restarts > at).any() else np.inf
        if ((ends > at) & (ends < until)).any():
            return True
        detail = row["detail"]
        ranks = [detail["rank"]] if "rank" in detail else detail.get("culprit_ranks") or []
        if not ranks or steps.empty:
            return False
        later = steps[(steps["time"] > at) & (steps["time"] < until)]
        return all((later["rank"] == int(r)).any() for r in ranks)

    return _rows(deaths, [outlived(row) for _, row in deaths.iterrows()])


def _crash(facts: RunFacts, w: Window) -> list[Cause]:
    """Ranks that died, and restarts that keep failing."""
    ev = facts.events
    faults, seen = _deaths(ev)
    # a live report (a heartbeat, the watchdog) that the rank then outlived is dropped; a
    # previous attempt's death, reported by the next one, is history and stays
    live = faults[[d.get("how") == "heartbeat stopped" for d in faults["detail"]]]
    faults = faults.drop(_outlived(facts, live).index)
    seen = seen.drop(_outlived(facts, seen).index)
    if faults.empty and seen.empty:
        return []
    # restarts: the attempts after the first, as torchrun restarted them or the job resumed
    restarts = max(int((ev["kind"] == "restart").sum()), int((ev["kind"] == "resume").sum()))
    dead = sorted(
        {int(d["rank"]) for d in faults["detail"] if "rank" in d}
        | {int(r) for d in seen["detail"] for r in d.get("culprit_ranks") or []}
    )
    finished = bool((ev["kind"] == "run_end").any())
    deaths = max(len(faults), len(seen))
    # one step per death: where the watchdog saw it happen, else where the next attempt says
    # the rank last beat (the two differ by the step in flight: never both)
    at = (seen if not seen.empty else faults)["step"].dropna()
    at = at[at >= 0]
    first = int(at.min()) if len(at) else None
    evidence = [
        f"{_who(dead)} died without an exit mark (no clean stop) at "
        f"step(s) {', '.join(str(s) for s in sorted({int(s) for s in at})) or '?'}",
        f"{restarts} restart(s); the run {'finished' if finished else 'did not finish'}",
    ]
    if len(_events_where(ev, "hang", "action", "abort")):
        return []  # the watchdog killed them on purpose: the hang is the cause (it says so)
    if (restarts >= 1 and not finished) or deaths >= 3:
        return [
            Cause(
                "recovery_failing",
                f"recovery keeps failing: {_who(dead)} died in {deaths} attempts",
                min(0.95, 0.8 + 0.05 * restarts),
                dead,
                first,
                evidence,
                "stop restarting: the fault comes back after every resume from the checkpoint (a "
                "bad host, a bad sample at that step, a code path that always fails); drain that "
                "rank's host or skip the data at that step",
            )
        ]
    action = (
        f"read rank {dead[0]}'s log and `dmesg` on its host (OOM killer, "
        "signal 9, a hardware error); torchrun restarted it from the last checkpoint"
    )
    return [Cause("crash", f"{_who(dead)} died at step {first}", 0.9, dead, first, evidence, action)]


HYPOTHESES: list[Callable[[RunFacts, Window], list[Cause]]] = [
    _hang_events,
    _stall,
    slow_host,
    _slow_link,
    hot_experts,
    _routing,
    _leak,
    _nonfinite,
    _crash,
    _checkpoint,
]
