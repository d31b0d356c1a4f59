"""meshscope view: `streamlit run view/app.py` (or `meshscope view`).

Pages through st.navigation. A deep link (`?run=ID&anomaly=EVENT_ID`, or an alert's
`?run=ID&alert=NAME&rank=R`) opens on the page that answers it, at the site's root or at the
page's own path (`/anomalies?...`). The Runs page stays the default: a default page is served
at the root only, so a path-style link to it would first say "Page not found".
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st

# imported as the installed package (an editable install in a checkout), never by a path guess
from meshscope.view.ui import PAGES

st.set_page_config(page_title="meshscope", layout="wide")
params = st.query_params
if "anomaly" in params or "alert" in params or "type" in params:
    landing = "anomalies"
elif "run" in params:
    landing = "run"
else:
    landing = "runs"
titles = {
    "runs": "Runs",
    "run": "Run",
    "anomalies": "Anomalies",
    "experts": "Experts",
    "debug": "Debug",
    "feedback": "Feedback",
    "advisor": "Advisor",
}
here = Path(__file__).parent
pages = {
    name: st.Page(str(here / path), title=titles[name], url_path=name, default=(name == "runs"))
    for name, path in PAGES.items()
}
current = st.navigation(list(pages.values()))
if current.url_path in ("", "runs") and landing != "runs":  # the root with a deep link
    st.switch_page(pages[landing], query_params=params.to_dict())
current.run()
