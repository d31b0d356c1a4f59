"""The loop itself: ingest serving load against a run and store ranked suggestions, approve
one into the run's controls table, settle outcomes into the knowledge base. `meshscope
feedback` and the view's Feedback page call these."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from meshscope.collector.controls import ControlChange
from meshscope.collector.rundir import run_info
from meshscope.collector.store import load_expert_load, load_expert_work, load_steps
from meshscope.feedback.knowledge import KnowledgeBase, measure_outcome
from meshscope.feedback.rebalance import placement_suggestions
from meshscope.feedback.serving import FeedbackError, read_serving_load
from meshscope.feedback.suggestions import LayerDiagnosis, Suggestion, diagnose, suggest, training_load


def control_for(suggestion: dict[str, Any]) -> ControlChange:
    """The bounded change that applies a stored suggestion; ControlError when none does."""
    from meshscope.collector.controls import ControlError

    if not suggestion.get("control"):
        raise ControlError(
            f"suggestion {suggestion.get('action')!r} is for "
            f"{suggestion.get('target')}: export it, it does not change training"
        )
    return ControlChange.parse(suggestion["control"])


@dataclass
class FeedbackReport:
    """What one ingest produced: the diagnosis and the ranked suggestions."""

    source: str
    diagnoses: list[LayerDiagnosis]
    suggestions: list[Suggestion]
    event_ids: list[int] = field(default_factory=list)


def ingest(
    run_dir: Path, data: bytes, name: str, *, devices: int = 8, kb: KnowledgeBase | None = None
) -> FeedbackReport:
    """Read a serving load, diagnose it against the run, store the suggestions as events."""
    from meshscope.collector.schema import Event
    from meshscope.collector.store import insert_events

    run_dir = Path(run_dir)
    serving = read_serving_load(data, name)
    diagnoses = diagnose(serving, training_load(run_dir))
    info = run_info(run_dir)
    suggestions = suggest(diagnoses, serving, model=info.model(), devices=devices, kb=kb)
    suggestions += placement_suggestions(run_dir, info.ep)  # expert parallelism: the training side
    suggestions.sort(key=lambda s: -s.score)
    from meshscope.collector.store import latest_step

    step = latest_step(run_dir)
    step = step if step >= 0 else None
    ids = insert_events(
        run_dir,
        [
            Event(
                kind="suggestion",
                run_id=run_dir.name,
                step=step,
                detail={**s.as_dict(), "status": "proposed", "source": serving.source},
            )
            for s in suggestions
        ],
    )
    return FeedbackReport(serving.source, diagnoses, suggestions, ids)


def approve(run_dir: Path, suggestion_id: int, by: str = "") -> int:
    """A person approved suggestion `suggestion_id`: queue its bounded change; the control id.
    Who (`by`: the person, or where the approval came from) is kept as an `approval` event."""
    from meshscope.collector import controls
    from meshscope.collector.schema import Event
    from meshscope.collector.store import insert_events, load_events

    events = load_events(run_dir, kind="suggestion")
    row = events[events["id"] == suggestion_id]
    if row.empty:
        raise FeedbackError(
            f"no suggestion {suggestion_id} in {run_dir} (ids: {events['id'].tolist()[-10:] or 'none'})"
        )
    control = controls.submit(run_dir, control_for(row.iloc[0]["detail"]), suggestion=suggestion_id)
    detail = {"suggestion": suggestion_id, "control": control, "by": by or "unnamed"}
    insert_events(run_dir, [Event(kind="approval", run_id=run_dir.name, detail=detail)])
    return control


def settle_outcomes(run_dir: Path, kb: KnowledgeBase, *, after: int) -> list[dict[str, Any]]:
    """Measure every applied change that has run `after` steps and has no outcome yet; store it
    on the change, as an `outcome` event and in the knowledge base."""
    from meshscope.collector import controls
    from meshscope.collector.schema import Event
    from meshscope.collector.store import insert_events, load_events

    run_dir = Path(run_dir)
    rows = controls.load_controls(run_dir)
    unsettled = rows[(rows["status"] == "applied") & rows["outcome"].isna()]
    if unsettled.empty:
        return []
    suggestions = {int(r["id"]): r["detail"] for _, r in load_events(run_dir, kind="suggestion").iterrows()}
    steps, experts = load_steps(run_dir), load_expert_load(run_dir)  # once for every change
    # a placement does not change routing, it evens the ranks: judged on each rank's experts' work
    ranks = load_expert_work(run_dir).rename(columns={"rank": "expert"})
    done = []
    for _, row in unsettled.iterrows():
        load = ranks if row["kind"] == "expert_placement" else experts
        measured = measure_outcome(steps, load, int(row["step"]), int(row["layer"]), after)
        if measured is None:
            continue
        s = suggestions.get(int(row["suggestion"])) if pd.notna(row["suggestion"]) else None
        cause = (s or {}).get("cause", "operator")
        action = (s or {}).get("action", row["kind"])
        predicted = (s or {}).get("expected", {})
        success = kb.record(
            run=run_dir.name,
            cause=cause,
            action=action,
            params={"values": row["payload"], "layer": int(row["layer"])},
            predicted=predicted,
            measured=measured,
        )
        outcome = {
            **measured,
            "success": success,
            "predicted": predicted,
            "control": int(row["id"]),
            "action": action,
        }
        controls.record_outcome(run_dir, int(row["id"]), outcome)
        insert_events(
            run_dir,
            [Event(kind="outcome", run_id=run_dir.name, step=int(row["step"]) + after, detail=outcome)],
        )
        done.append(outcome)
    return done


def export_placement(suggestions: list[Suggestion], path: Path) -> Path:
    """Serving placements as one JSON file: per layer, each slot's logical expert and device
    (vLLM's physical_to_logical_map and SGLang's init_expert_location take this shape)."""
    layers = {
        str(s.layer): {
            "physical_to_logical_map": s.params["slot_expert"],
            "device_of_slot": s.params["device_of_slot"],
            "replicas": s.params["replicas"],
            "expected": s.expected,
        }
        for s in suggestions
        if s.action == "placement"
    }
    path.write_text(json.dumps({"format": "meshscope-placement/1", "layers": layers}, indent=1))
    return path
