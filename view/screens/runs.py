"""Runs: every run's health, throughput and faults at a glance."""

import time

import streamlit as st

from meshscope.view import ui

st.title("Runs")
root = ui.settings().runs_dir
table = ui.runs_table(str(root), int(time.time() // 5))
if table.empty:
    st.info(f"No runs under {root.resolve()} yet: `meshscope run` writes one there.")
    st.stop()
cols = st.columns(4)
cols[0].metric("runs", len(table))
cols[1].metric("running", int((table["status"] == "running").sum()))
cols[2].metric("with anomalies", int((table.get("anomalies", 0) > 0).sum()))
cols[3].metric(
    "with hangs or faults", int(((table.get("hangs", 0) > 0) | (table.get("faults", 0) > 0)).sum())
)
picked = st.dataframe(
    table,
    hide_index=True,
    on_select="rerun",
    selection_mode="single-row",
    key="runs",
    column_config={
        "step_s_p50": st.column_config.NumberColumn("step s (p50)", format="%.3f"),
        "tokens_per_s": st.column_config.NumberColumn("tokens/s", format="%.0f"),
        "loss": st.column_config.NumberColumn(format="%.3f"),
    },
)
rows = picked.selection.rows if picked is not None else []
if rows:
    st.switch_page(ui.page_file("run"), query_params={"run": table.iloc[rows[0]]["run"]})
for name in table["run"].head(20):
    st.page_link(ui.page_file("run"), label=f"open {name}", query_params={"run": name})
