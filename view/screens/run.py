"""Run: where the time went (one stacked bar for the job and one per rank), the TEI and the
maturity level; compute, exposed communication and step time per rank, the communication
ratio, loss, and one timeline of events."""

import plotly.express as px
import streamlit as st

from meshscope.collector.figures import node_hops, with_compute
from meshscope.collector.maturity import maturity
from meshscope.collector.report import across_nodes, efficiency, efficiency_text
from meshscope.collector.timeaccount import BUCKET_COLOURS, BUCKETS, account_bars
from meshscope.view import data, ui

run_dir, facts = ui.open_run("Run")
summary = data.run_summary(run_dir)
c = st.columns(6)
c[0].metric("status", summary.get("status", "?"))
c[1].metric("steps", summary.get("steps", 0))
c[2].metric("ranks", summary.get("ranks", 0))
c[3].metric("step s (p50)", f"{summary.get('step_s_p50', float('nan')):.3f}")
c[4].metric("anomalies", summary.get("anomalies", 0))
c[5].metric("hangs / faults", f"{summary.get('hangs', 0)} / {summary.get('faults', 0)}")
prometheus = ui.settings().prometheus_url
if prometheus and summary.get("status") in ("running", "recovering"):
    try:
        live = data.live_metrics(prometheus, run_dir.name)
    except OSError as err:
        st.warning(f"live figures unavailable, showing the store only: {err}")
    else:
        st.subheader("Live (Prometheus)")
        st.dataframe(live, hide_index=True, key="live")
steps = facts.steps
if steps.empty:
    st.info("No step recorded yet.")
    st.stop()
efficiency_figures = efficiency(run_dir, steps, facts.events)
account = efficiency_figures["account"]
st.markdown(f"**Where the time went**: {account.text()}")
st.plotly_chart(
    px.bar(
        account_bars(account),
        x="seconds",
        y="who",
        color="bucket",
        orientation="h",
        color_discrete_map=BUCKET_COLOURS,
        category_orders={"bucket": list(BUCKETS)},
        title="wall time by bucket: the job (mean over ranks) and each rank",
    ),
    key="time_account",
)
st.markdown(f"**Training efficiency index**: {efficiency_text(efficiency_figures)}")
st.markdown(f"**Maturity**: {maturity(run_dir, steps, facts.events).text()}")
per_rank = with_compute(steps).assign(rank=steps["rank"].astype(str))
# under synchronous DDP every rank's step lasts as long as the slowest's: the straggler is the one
# whose own compute is long, while its peers' exposed communication (the wait for it) is
st.plotly_chart(
    px.line(per_rank, x="step", y="compute_s", color="rank", title="compute per rank (s): who is slow"),
    key="compute",
)
top_left, top_right = st.columns(2)
top_left.plotly_chart(
    px.line(per_rank, x="step", y="comm_exposed_s", color="rank", title="exposed communication per rank (s)"),
    key="comm_exposed",
)
top_right.plotly_chart(
    px.line(per_rank, x="step", y="step_s", color="rank", title="step time per rank (s)"), key="step_time"
)
left, right = st.columns(2)
left.plotly_chart(
    px.line(per_rank, x="step", y="comm_ratio", color="rank", title="exposed communication / step"),
    key="comm_ratio",
)
right.plotly_chart(px.line(per_rank, x="step", y="loss", color="rank", title="loss"), key="loss")
if across_nodes(steps):  # gradients crossed nodes
    st.subheader("Across nodes")
    inter = steps.assign(inter_mb=steps["bytes_inter"] / 1e6, rank=steps["rank"].astype(str))
    st.plotly_chart(
        px.line(inter, x="step", y="inter_mb", color="rank", title="gradient MB each rank sent across nodes"),
        key="bytes_inter",
    )
    hops = node_hops(steps)
    if hops.empty:
        st.caption("One flat all-reduce: communication inside and across nodes is not timed apart.")
    else:
        per_hop = hops.groupby(["step", "hop"], as_index=False)["seconds"].mean()
        title = "communication inside / across nodes (s)"
        st.plotly_chart(px.line(per_hop, x="step", y="seconds", color="hop", title=title), key="hops")
redone = data.redone_steps(run_dir, steps)
if not redone.empty:
    st.subheader("Steps redone after a restart")
    first, last = int(redone["step"].min()), int(redone["step"].max())
    st.caption(
        f"Steps {first}–{last} ran in {redone['attempt'].nunique()} attempts: a restart resumed from an "
        "earlier checkpoint. The charts above show the attempt that completed each step; "
        "here is every attempt."
    )
    st.plotly_chart(
        px.line(
            redone, x="step", y="step_s", color="attempt", line_dash="rank", title="step time per attempt (s)"
        ),
        key="attempts",
    )
events = data.timeline(facts.events)
st.subheader("Events")
if events.empty:
    st.caption("No events.")
else:
    st.plotly_chart(
        px.scatter(
            events, x="step", y="kind", color="severity", hover_data=["rank", "summary"], title="timeline"
        ),
        key="timeline",
    )
    st.dataframe(events, hide_index=True, key="events")
if facts.anomalies:
    st.page_link(
        ui.page_file("anomalies"),
        label=f"{len(facts.anomalies)} anomalies: drill down",
        query_params={"run": run_dir.name},
    )
