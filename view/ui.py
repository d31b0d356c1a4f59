"""Streamlit plumbing shared by the pages: settings, cached loading, the run picker and deep
links. Loading is cached per (run, store version): a live run refreshes as it writes."""

from __future__ import annotations

import hmac
from pathlib import Path

import pandas as pd
import streamlit as st

from meshscope.collector.store import (
    load_events,
    load_expert_load,
    load_grad_stats,
    load_steps,
    load_tensor_stats,
)
from meshscope.explain.facts import Cause, RunFacts, UnknownAnomaly
from meshscope.explain.ranking import explain
from meshscope.view import data
from meshscope.view.settings import ViewSettings

PAGES = {
    "runs": "screens/runs.py",
    "run": "screens/run.py",
    "anomalies": "screens/anomalies.py",
    "experts": "screens/experts.py",
    "debug": "screens/debug.py",
    "feedback": "screens/feedback.py",
    "advisor": "screens/advisor.py",
}


def page_file(name: str) -> str:
    """A page's script path, as st.switch_page and st.page_link take it."""
    return str(Path(__file__).parent / PAGES[name])


def token_matches(path: Path, given: str) -> bool:
    """Whether `given` is the token in `path` (compared in constant time)."""
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return False
    return bool(token) and hmac.compare_digest(token.encode(), given.strip().encode())


def settings() -> ViewSettings:
    """The view's settings (from MESHSCOPE_VIEW_*); a bad value stops the page with its name."""
    try:
        return ViewSettings.from_env()
    except ValueError as err:
        st.error(str(err))
        st.stop()


@st.cache_data(ttl=5, show_spinner=False)
def runs_table(runs_dir: str, _now_bucket: int) -> pd.DataFrame:
    return data.runs_table(Path(runs_dir))


@st.cache_data(show_spinner="reading the run store…")
def facts(run_dir: str, version: float) -> RunFacts:
    """Everything root cause reads about the run, cached per store version."""
    return RunFacts.load(run_dir)


@st.cache_data(show_spinner=False)
def grad_stats(run_dir: str, version: float) -> pd.DataFrame:
    """The gradient inspector's per-layer table, cached per store version."""
    return load_grad_stats(run_dir)


@st.cache_data(show_spinner=False)
def tensor_stats(run_dir: str, version: float) -> pd.DataFrame:
    """The tracer's per-module statistics (`--trace stats|full`), cached per store version."""
    return load_tensor_stats(run_dir)


@st.cache_data(show_spinner="ranking causes…")
def causes(run_dir: str, version: float, anomaly_id: int | None, start: int, kind: str) -> list[Cause]:
    """Ranked causes of one anomaly (or hang, found by its start step and type)."""
    from meshscope.explain.ranking import causes_for

    f = facts(run_dir, version)
    if anomaly_id is not None:
        try:
            return explain(f, anomaly_id)
        except UnknownAnomaly:
            pass  # a hang event: explained by its window below
    a = next((x for x in data.anomalies_with_hangs(f) if x.start_step == start and x.type == kind), None)
    return causes_for(f, a) if a is not None else []


def run_facts(run_dir: Path) -> RunFacts:
    """The run's facts, cached until its store changes."""
    return facts(str(run_dir), data.store_version(run_dir))


def pick_run() -> Path | None:
    """The run in the URL (?run=ID), else the one this session chose last, else a picker over
    the runs folder; kept in the URL so every state is a link."""
    root = settings().runs_dir
    names = [p.name for p in data.run_dirs(root)]
    # the sidebar's page links drop the URL's parameters: the session remembers the run
    wanted = st.query_params.get("run") or st.session_state.get("run")
    if wanted and not data.exists(root / wanted):
        st.error(f"run {wanted!r} is not in {root} (runs there: {', '.join(names[:10]) or 'none'})")
        wanted = None
    if not names:
        st.info(f"No runs under {root.resolve()} yet: `meshscope run` writes one there.")
        return None
    choice = st.sidebar.selectbox("run", names, index=names.index(wanted) if wanted in names else 0)
    if st.query_params.get("run") != choice:
        st.query_params["run"] = choice
    st.session_state["run"] = choice
    return root / choice


def open_run(title: str) -> tuple[Path, RunFacts]:
    """The page's run (from the URL or the picker) and its facts, under a `title · run`
    heading; stops the page when there is no run to show."""
    run_dir = pick_run()
    if run_dir is None:
        st.stop()
    facts = run_facts(run_dir)
    st.title(f"{title} · {run_dir.name}")
    return run_dir, facts


def show_causes(found: list[Cause], limit: int = 5) -> None:
    """Ranked causes, each with its evidence and next action."""
    if not found:
        st.info("No probable cause found in the data around it.")
        return
    for i, c in enumerate(found[:limit], 1):
        with st.container(border=True):
            st.markdown(f"**{i}. {c.kind}** · confidence {c.confidence:.0%} · {c.title}")
            for line in c.evidence:
                st.markdown(f"- {line}")
            st.markdown(f"**Next:** {c.action}")


# Re-exported for the pages (one import line each).
__all__ = [
    "PAGES",
    "settings",
    "runs_table",
    "run_facts",
    "pick_run",
    "show_causes",
    "causes",
    "grad_stats",
    "load_steps",
    "load_events",
    "load_expert_load",
]
