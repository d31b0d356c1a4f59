"""Experts: layer × expert load over steps (heatmap), balancedness and estimated drops; under
expert parallelism, the tokens each rank's experts processed."""

import plotly.express as px
import streamlit as st

from meshscope.collector.rundir import run_info
from meshscope.collector.store import load_expert_work
from meshscope.view import data, ui

run_dir, facts = ui.open_run("Experts")
if facts.experts.empty:
    st.info("No expert load recorded (a dense model, or no window closed yet).")
    st.stop()
info = run_info(run_dir)
layers = sorted(int(x) for x in facts.experts["layer"].unique())
wanted = st.query_params.get("layer")
layer = st.sidebar.selectbox(
    "layer",
    layers,
    index=layers.index(int(wanted)) if wanted and wanted.isdigit() and int(wanted) in layers else 0,
)
if st.query_params.get("layer") != str(layer):
    st.query_params["layer"] = str(layer)
ranks = int(facts.steps["rank"].nunique()) if not facts.steps.empty else 1
view = data.expert_view(
    facts.experts,
    layer,
    capacity_factor=info.capacity_factor,
    ranks=ranks,
    steps_per_window=info.expert_every or 1,
)
k = info.top_k
c = st.columns(4)
c[0].metric("experts", view.shares.shape[1])
c[1].metric("top-k", k if k else "?")
c[2].metric("balancedness (last)", f"{view.balancedness.iloc[-1]:.2f}")
c[3].metric("balancedness (min)", f"{view.balancedness.min():.2f}")
heat = px.imshow(
    view.shares.T,
    aspect="auto",
    origin="lower",
    color_continuous_scale="Viridis",
    labels={"x": "step", "y": "expert", "color": "share"},
    title=f"layer {layer}: share of routed tokens (balanced = {1 / view.shares.shape[1]:.3f})",
)
st.plotly_chart(heat, key="heatmap")
frame = data.balancedness(facts.experts)
st.plotly_chart(
    px.line(
        frame.assign(layer=frame["layer"].astype(str)),
        x="step",
        y="balancedness",
        color="layer",
        title="balancedness (mean / max expert load; 1 = balanced)",
    ),
    key="balancedness",
)
if info.capacity_factor:
    st.plotly_chart(
        px.area(
            view.dropped.rename("dropped").reset_index(),
            x="step",
            y="dropped",
            title=f"layer {layer}: estimated share of tokens over capacity (factor {info.capacity_factor})",
        ),
        key="dropped",
    )
work = load_expert_work(run_dir)
if not work.empty:  # expert parallelism: each rank holds some experts and does their work
    st.subheader("Work per rank (expert parallelism)")
    mine = work[work["layer"] == layer]
    per_step = mine.assign(rank=mine["rank"].astype(str), tokens=mine["tokens"] / (info.expert_every or 1))
    st.caption(
        "Tokens the experts each rank holds processed per step (every sender's, within capacity): "
        "a rank far above the others holds hot experts and makes its peers wait in the all-to-all."
    )
    st.plotly_chart(
        px.line(
            per_step, x="step", y="tokens", color="rank", title=f"layer {layer}: tokens processed per rank"
        ),
        key="work",
    )
