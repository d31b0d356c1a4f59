"""Feedback: serving-side expert load in, ranked suggestions, approval into the running trainer,
outcomes measured against the prediction, and what the knowledge base has learnt."""

import json
import tempfile
from pathlib import Path

import pandas as pd
import plotly.express as px
import streamlit as st

from meshscope.collector.controls import ControlError, load_controls
from meshscope.collector.store import load_events
from meshscope.feedback.knowledge import knowledge_base
from meshscope.feedback.loop import approve, export_placement, ingest, settle_outcomes
from meshscope.feedback.serving import FeedbackError
from meshscope.feedback.suggestions import Suggestion
from meshscope.view import ui

run_dir, _ = ui.open_run("Feedback")
settings = ui.settings()
kb = knowledge_base(settings.runs_dir)

st.header("1. Serving load in")
st.caption(
    "SGLang's expert-distribution dump (.pt, `logical_count`), vLLM's EPLB load window "
    "(.pt, `expert_load_window`), or a CSV with columns layer, expert, tokens[, latency_ms]."
)
upload = st.file_uploader("serving expert load", type=["pt", "pth", "csv"], key="upload")
devices = st.number_input(
    "serving devices (for the placement)", min_value=1, max_value=4096, value=8, key="devices"
)
if upload is not None and st.button("diagnose and suggest", key="ingest"):
    try:
        report = ingest(run_dir, upload.getvalue(), upload.name, devices=int(devices), kb=kb)
    except FeedbackError as err:
        st.error(str(err))
    else:
        st.session_state["report"] = report
report = st.session_state.get("report")
if report is not None:
    diag = pd.DataFrame(
        [
            {
                "layer": d.layer,
                "serving": d.serving_balancedness,
                "training": d.training_balancedness,
                "hot experts": str(d.hot),
                "cold experts": str(d.cold),
                "latency cost ms": d.latency_cost_ms,
            }
            for d in report.diagnoses
        ]
    )
    st.subheader(f"Diagnosis ({report.source})")
    st.dataframe(diag, hide_index=True, key="diagnosis")
    long = diag.melt(
        id_vars="layer", value_vars=["serving", "training"], var_name="where", value_name="balancedness"
    )
    st.plotly_chart(
        px.bar(
            long,
            x="layer",
            y="balancedness",
            color="where",
            barmode="group",
            title="balancedness per layer (1 = balanced)",
        ),
        key="diag_chart",
    )

st.header("2. Suggestions")
if settings.changes_token_file is not None:  # `--allow-changes`: approvals queue live changes
    st.text_input("your name (kept with each approval)", key="approver")
    st.text_input("token (from the view's --allow-changes file)", type="password", key="token")
events = load_events(run_dir, kind="suggestion")
changes = load_controls(run_dir)
by_suggestion = {int(r["suggestion"]): r for _, r in changes.iterrows() if pd.notna(r["suggestion"])}
if events.empty:
    st.caption("None yet: upload a serving load above, or `meshscope feedback ingest`.")
# the CLI's ranking: the latest ingest's suggestions, best first (ids ascend in rank order)
for _, row in events.sort_values("id").tail(12).iterrows():
    d, sid = row["detail"], int(row["id"])
    with st.container(border=True):
        st.markdown(
            f"**#{sid} {d['action']}** ({d['target']}, layer {d['layer']}) · expected "
            f"`{json.dumps(d['expected'])}`"
        )
        st.caption(d.get("why", ""))
        change = by_suggestion.get(sid)
        if change is not None:
            st.markdown(
                f"change #{int(change['id'])}: **{change['status']}**"
                + (f" at step {int(change['step'])}" if pd.notna(change["step"]) else "")
                + (f" — {change['note']}" if change["note"] else "")
            )
        elif d.get("control") and settings.changes_token_file is None:
            st.caption("Read-only view: start it with `--allow-changes TOKEN_FILE` to approve changes.")
        elif d.get("control"):
            if st.button(f"approve #{sid}", key=f"approve-{sid}"):
                if not ui.token_matches(settings.changes_token_file, st.session_state.get("token", "")):
                    st.error("the token is wrong: nothing was queued")
                else:
                    try:
                        cid = approve(run_dir, sid, by=st.session_state.get("approver", ""))
                    except (FeedbackError, ControlError) as err:
                        st.error(str(err))
                    else:
                        st.success(f"change #{cid} queued: the trainer applies it at its next control step")
        elif d["action"] == "placement":
            path = export_placement(
                [Suggestion(**{k: v for k, v in d.items() if k in Suggestion.__dataclass_fields__})],
                Path(tempfile.mkdtemp()) / "placement.json",
            )
            st.download_button(
                "export placement (JSON)",
                path.read_bytes(),
                file_name=f"placement-layer{d['layer']}.json",
                key=f"export-{sid}",
            )

st.header("3. Applied changes and their outcomes")
if changes.empty:
    st.caption("No change approved for this run.")
else:
    st.dataframe(changes.drop(columns=["created"]), hide_index=True, key="changes")
if st.button(f"measure outcomes (after {settings.outcome_after} steps)", key="measure"):
    done = settle_outcomes(run_dir, kb, after=settings.outcome_after)
    st.success(f"{len(done)} outcome(s) measured" if done else "no applied change has run long enough yet")
outcomes = changes.dropna(subset=["outcome"]) if not changes.empty else changes
for _, row in outcomes.iterrows():
    o = row["outcome"]
    st.markdown(
        f"change #{int(row['id'])}: balancedness {o['balancedness_before']:.2f} → "
        f"{o['balancedness_after']:.2f} (predicted "
        f"{o['predicted'].get('balancedness_after', '?')}), loss ×{o['loss_ratio']:.3f}, "
        f"step time ×{o['step_s_ratio']:.2f} — "
        f"{'worked' if o['success'] else 'did not work'}"
    )

st.header("4. Knowledge base (every run)")
table = kb.table()
if table.empty:
    st.caption("No outcome recorded yet.")
else:
    st.dataframe(table, hide_index=True, key="kb")
