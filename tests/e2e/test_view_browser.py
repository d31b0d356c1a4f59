"""The real `meshscope view` server in headless Chromium: an alert's link opens on the hang and
the culprit rank is on the page; a straggler's deep link shows the ranked cause. Screenshots are
kept in test-artifacts/ (CI keeps that folder)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys

import pytest

from fixtures.runs import REPO, start_view
from fixtures.servers import missing
from tests.conftest import require_binary

pytestmark = pytest.mark.e2e
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Two recorded runs (a hang, a straggler with its anomalies detected)."""
    runs = tmp_path_factory.mktemp("runs")
    for name in ("skip_collective", "slow"):
        shutil.copytree(REPO / "fixtures" / "stores" / name, runs / name)
    subprocess.run(
        [sys.executable, "-m", "meshscope", "detect", "--run", str(runs / "slow")],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=120,
    )
    return runs


@contextlib.contextmanager
def serving(runs):
    """`meshscope view` over `runs`, as a person starts it; its URL."""
    proc, url = start_view(runs)
    try:
        yield url
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=20)


@pytest.fixture(scope="module")
def view(recorded):
    with serving(recorded) as url:
        yield url, recorded


@pytest.fixture(scope="module")
def browser():
    chromium = require_binary("chromium")
    try:
        from playwright import sync_api
    except ImportError:
        missing("playwright is not installed")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        yield b
        b.close()


def _open(browser, url: str, wait_for: str, shot: str):
    page = browser.new_page(viewport={"width": 1400, "height": 1800})
    page.goto(url, timeout=60_000)
    page.get_by_text(wait_for, exact=False).first.wait_for(timeout=60_000)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / shot), full_page=True)
    body = page.inner_text("body")
    page.close()
    return body


def test_an_alert_link_shows_the_hang_culprit(view, browser):
    url, _ = view
    # what the HangDetected alert links to (Alertmanager's template and the embedded alerts)
    body = _open(browser, f"{url}/?run=skip_collective&alert=HangDetected", "Next:", "view-hang-alert.png")
    assert "hang · ranks [1]" in body
    assert "rank 1: missing at all_reduce #24" in body
    assert (ARTIFACTS / "view-hang-alert.png").stat().st_size > 10_000


def test_a_straggler_deep_link_shows_the_slow_host(view, browser):
    url, runs = view
    from meshscope.collector.store import load_events

    ev = load_events(runs / "slow", kind="anomaly")
    aid = int(ev.iloc[0]["id"])
    body = _open(browser, f"{url}/anomalies?run=slow&anomaly={aid}", "slow_host", "view-straggler.png")
    assert "rank 1 computes" in body and "Next:" in body


@pytest.mark.parametrize(
    "link,title",
    [("run?run=slow", "Run"), ("anomalies?run=slow", "Anomalies")],  # what alerts link to
)
def test_a_deep_link_on_a_fresh_server_shows_the_page_in_its_layout(recorded, browser, link, title):
    # an alert's link is often the first request a server gets: no one opened `/` before it
    with serving(recorded) as url:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{url}/{link}", timeout=60_000)
        nav = page.locator('[data-testid="stSidebarNav"]')
        nav.wait_for(timeout=60_000)
        page.get_by_role("heading").first.wait_for(timeout=60_000)
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"view-fresh-{link.split('?')[0]}.png"), full_page=True)
        entries = [e.strip() for e in nav.inner_text().splitlines() if e.strip()]
        wide = page.locator('[data-testid="stMainBlockContainer"]').bounding_box()["width"]
        page.close()
    # the pages by their titles, never the files they live in ("app", "anomalies", ...)
    assert entries == ["Runs", "Run", "Anomalies", "Experts", "Debug", "Feedback", "Advisor"], entries
    assert wide > 900, wide  # the wide layout, not Streamlit's narrow default


def test_a_path_style_deep_link_then_the_sidebar_keeps_the_run(view, browser):
    """/anomalies?run=... opens the page itself (never "Page not found" first), and a page
    chosen in the sidebar after it shows the same run, not the newest one."""
    url, _ = view
    page = browser.new_page(viewport={"width": 1400, "height": 1200})
    seen: list[str] = []
    page.on("console", lambda msg: seen.append(msg.text))
    page.goto(f"{url}/anomalies?run=skip_collective", timeout=60_000)
    page.get_by_role("heading", name="skip_collective", exact=False).first.wait_for(timeout=60_000)
    first = page.inner_text("body")
    page.locator('[data-testid="stSidebarNav"]').get_by_text("Experts", exact=True).click()
    page.wait_for_url("**/experts**", timeout=60_000)
    page.get_by_role("heading").first.wait_for(timeout=60_000)
    page.wait_for_timeout(1500)  # the page's script has run
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "view-sidebar-after-deep-link.png"), full_page=True)
    after = page.inner_text("body")
    page.close()
    assert "Page not found" not in first + " ".join(seen), first[:500]
    assert "skip_collective" in after and "Experts" in after, after[:500]
