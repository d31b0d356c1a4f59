"""Advisor: the layouts of this run's model ranked on a cluster, the chosen one's breakdown,
and what this run's measurements changed in the cost model."""

import pandas as pd
import plotly.express as px
import streamlit as st

from meshscope.advisor.advise import advise
from meshscope.advisor.calibrate import CalibrationError, calibrate, measure, predict_run
from meshscope.advisor.cost import PARTS, Factors
from meshscope.advisor.specs import AdvisorConfig, SpecError, examples, load_cluster, load_model
from meshscope.view import ui

run_dir, _ = ui.open_run("Advisor")
try:
    run = measure(run_dir)
except CalibrationError as err:
    run = None
    st.info(f"This run cannot describe its own model ({err}); pick a bundled model instead.")
clusters = examples("cluster")
left, right = st.columns(2)
cluster_name = left.selectbox(
    "cluster", list(clusters), index=list(clusters).index("cpu-local"), key="cluster"
)
model_names = (["this run's model"] if run else []) + list(examples("model"))
model_name = right.selectbox("model", model_names, key="model")
try:
    cluster = load_cluster(cluster_name)
    model = run.model if run and model_name == "this run's model" else load_model(model_name)
except SpecError as err:
    st.error(str(err))
    st.stop()
use_run = (
    run is not None
    and st.toggle("calibrate on this run", value=run.backend in ("", cluster.backend), key="calibrate")
    and run.backend in ("", cluster.backend)
)
fitted = calibrate([run_dir], cluster) if use_run else None
if fitted is not None and fitted.runs and fitted.runs[0].left_out:
    st.caption(f"Calibrated on this run's undisturbed steps: {fitted.runs[0].left_out}.")
factors = fitted.factors if fitted else Factors()
if run is not None and run.backend not in ("", cluster.backend):
    st.caption(
        f"This run ran on {run.backend}; the {cluster.name} file is for {cluster.backend}: defaults only."
    )

advice = advise(model, cluster, AdvisorConfig(), factors)
st.markdown(f"**{advice.evaluated:,} layouts** of {model.name} on {cluster.devices} × {cluster.device.name}.")
st.markdown(f"**Binding constraint**: {advice.binding}")
if advice.ranked.empty:
    st.stop()
shown = advice.ranked.head(20)
st.dataframe(
    shown[["label", "step_s", "step_lo_s", "step_hi_s", "tokens_per_s", "memory_gib", "comm_ratio", "bound"]],
    hide_index=True,
    key="ranked",
)
chosen = st.selectbox("breakdown of", list(shown.label), key="chosen")
row = shown[shown.label == chosen].iloc[0]
parts = pd.DataFrame({"part": list(PARTS.values()), "seconds": [row[k] for k in PARTS]})
st.plotly_chart(
    px.bar(parts, x="part", y="seconds", title=f"{chosen}: predicted step {row.step_s:.3g} s"), key="parts"
)

st.subheader("What this run changed in the model")
default = Factors()
changed = pd.DataFrame(
    [
        {
            "factor": name,
            "default": getattr(default, name),
            "now": getattr(factors, name),
            "from": factors.source(name),
        }
        for name in Factors.names()
    ]
)
st.dataframe(changed, hide_index=True, key="factors")
if run is not None and model_name == "this run's model":
    before, after = predict_run(run, cluster, default), predict_run(run, cluster, factors)
    st.markdown(
        f"This run's own layout ({run.layout.label()}): measured **{run.step_s * 1e3:.1f} ms** a step; "
        f"predicted {before.step_s * 1e3:.1f} ms with the defaults, {after.step_s * 1e3:.1f} ms "
        f"({after.step_lo_s * 1e3:.1f}–{after.step_hi_s * 1e3:.1f}) with what it measured."
    )
