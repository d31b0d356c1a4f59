"""Debug: hang diagnoses (culprit, collective, stacks), tensor-tracer findings and statistics,
gradients per layer."""

import plotly.express as px
import streamlit as st

from meshscope.view import data, ui

run_dir, facts = ui.open_run("Debug")
ev = facts.events
hangs = ev[ev["kind"] == "hang"]
st.header("Hangs")
if hangs.empty:
    st.caption("No hang diagnosed.")
for _, row in hangs.iterrows():
    d = row["detail"]
    with st.container(border=True):
        st.markdown(
            f"**{d.get('type')}** · culprit **ranks {d.get('culprit_ranks')}** · "
            f"{d.get('op') or ''} #{d.get('seq') if d.get('seq') is not None else '-'} "
            f"on group {d.get('group') or '-'} · action {d.get('action', '-')}"
        )
        st.write(d.get("why", ""))
        for rank, stack in sorted((d.get("stacks") or {}).items()):
            with st.expander(f"rank {rank} stack (innermost last)"):
                st.code("\n".join(stack[-20:]))
st.header("Tracer findings")
nans = ev[ev["kind"] == "nan"]
snaps = ev[ev["kind"] == "snapshot"]
if nans.empty:
    st.caption("No non-finite value found.")
else:
    st.dataframe(data.timeline(nans), hide_index=True, key="nan_events")
for _, row in snaps.iterrows():
    st.markdown(
        f"snapshot of `{row['detail'].get('module')}` at step {row['step']}: "
        f"`meshscope replay {row['detail'].get('path')}`"
    )
grads = ui.grad_stats(str(run_dir), data.store_version(run_dir))
if not grads.empty:
    st.header("Gradients per layer")
    st.plotly_chart(
        px.line(grads, x="step", y="grad_norm", color="module", log_y=True, title="gradient norm per layer"),
        key="grad_norm",
    )
stats = ui.tensor_stats(str(run_dir), data.store_version(run_dir))
if not stats.empty:
    st.header("Tensor statistics per module")
    st.caption(
        "From `--trace stats` (every 10th step) or `full`: each module's outputs, reduced on the device."
    )
    module = st.selectbox("module", sorted(stats["module"].unique()), key="stats_module")
    picked = stats[stats["module"] == module]
    st.plotly_chart(
        px.line(
            picked,
            x="step",
            y="absmax",
            color="rank",
            line_dash="where",
            log_y=True,
            title=f"{module}: absmax",
        ),
        key="tensor_absmax",
    )
    bad = stats[stats["nonfinite"] > 0]
    if not bad.empty:
        st.dataframe(bad.sort_values(["step", "rank"]), hide_index=True, key="tensor_nonfinite")
