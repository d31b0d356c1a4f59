"""Anomalies: the list, and a drill-down into one: the window around it, the ranks compared,
the evidence, related faults/hangs/tracer findings, ranked causes and the next action."""

import pandas as pd
import plotly.express as px
import streamlit as st

from meshscope.view import data, ui

run_dir, facts = ui.open_run("Anomalies")
found = data.anomalies_with_hangs(facts)
if not found:
    st.success("No anomaly and no hang in this run.")
    st.stop()
if any(a.id is None for a in found):
    st.caption(
        "No detector judged this run live: these anomalies come from a replay "
        f"(`meshscope detect --run {run_dir}` stores them)."
    )
params = {
    k: st.query_params.get(k, "") for k in ("anomaly", "type", "start", "step", "alert", "rank", "layer")
}
linked = data.resolve_link(params, found)
if params["alert"] and linked is None:
    st.warning(f"Alert {params['alert']}: no matching anomaly stored yet (it may still be open).")
elif params["anomaly"] and linked is None:  # a link to an id this run does not have: say so
    st.warning(f"Anomaly #{params['anomaly']} is not in this run; showing the latest one instead.")
labels = [
    f"#{a.id if a.id is not None else '-'} {a.type} ranks={a.ranks or '-'} "
    f"steps {a.start_step}–{a.end_step}" + (f" layer {a.layer}" if a.layer is not None else "")
    for a in found
]
index = found.index(linked) if linked is not None else len(found) - 1
table = pd.DataFrame(
    [
        {
            "id": a.id,
            "type": a.type,
            "ranks": str(a.ranks),
            "start": a.start_step,
            "end": a.end_step,
            "layer": a.layer,
            "expert": a.expert,
            "score": round(a.score, 3),
        }
        for a in found
    ]
)
st.dataframe(table, hide_index=True, key="anomaly_list")
choice = st.selectbox("drill into", range(len(found)), index=index, format_func=labels.__getitem__)
a = found[choice]
wanted = data.link_query(run_dir.name, a)
current = {k: v for k, v in st.query_params.items()}
for k, v in [kv.split("=", 1) for kv in wanted.split("&")]:
    if current.get(k) != v:
        st.query_params[k] = v

where = "".join(f" · {k} {v}" for k, v in (("layer", a.layer), ("expert", a.expert)) if v is not None)
st.header(f"{a.type} · ranks {a.ranks or '—'} · steps {a.start_step}–{a.end_step}{where}")
st.markdown(f"Link to this view: `?{wanted}`")
if a.layer is not None and a.type == "expert_imbalance":
    st.page_link(
        "screens/experts.py",
        label=f"layer {a.layer}'s load heatmap",
        query_params={"run": run_dir.name, "layer": str(a.layer)},
    )
win = data.window(facts.steps, a)
if not win.empty:
    fig = px.line(
        win.assign(rank=win["rank"].astype(str)),
        x="step",
        y="step_s",
        color="rank",
        title="step time around it (s)",
    )
    fig.add_vrect(
        x0=a.start_step - 0.5,
        x1=max(a.end_step, a.start_step) + 0.5,
        fillcolor="red",
        opacity=0.15,
        line_width=0,
    )
    st.plotly_chart(fig, key="window")
    st.subheader("Ranks compared (median inside vs the 30 steps before)")
    st.dataframe(data.ranks_compared(facts.steps, a), hide_index=True, key="ranks_compared")
st.subheader("Evidence")
evidence = data.evidence_rows(a.evidence)
if evidence.empty:
    st.caption("No evidence recorded with it.")
else:
    st.dataframe(evidence, hide_index=True, key="evidence")
related = data.related_events(facts.events, a)
st.subheader("Related faults, hangs and tracer findings")
if related.empty:
    st.caption("None within 10 steps.")
else:
    st.dataframe(related, hide_index=True, key="related")
st.subheader("Probable causes")
ui.show_causes(ui.causes(str(run_dir), data.store_version(run_dir), a.id, a.start_step, a.type))
link = data.grafana_link(ui.settings().grafana_url, run_dir.name, a, facts.steps)
if link:
    st.link_button("open in Grafana", link)
