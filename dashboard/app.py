"""ctxsparse dashboard: ``streamlit run dashboard/app.py`` (or ``make dashboard``).

Reads the store read-only (``$CTXSPARSE_DB_URL`` or the default SQLite file); the pages in ``views/`` only draw,
``dashboard/data.py`` does every read.
"""
from __future__ import annotations

import streamlit as st

from dashboard import data

st.set_page_config(page_title="ctxsparse", page_icon=":material/scatter_plot:", layout="wide")

with st.sidebar:
    st.caption(f"store: `{data.display_url()}` (read-only)")
    if st.button("Refresh", help=f"re-read the store now (reads are cached for {data.TTL_S} s)"):
        data.clear_caches()

page = st.navigation([
    st.Page("views/overview.py", title="Overview", icon=":material/dashboard:", default=True),
    st.Page("views/pareto.py", title="Pareto", icon=":material/scatter_plot:", url_path="pareto"),
    st.Page("views/unit.py", title="Unit", icon=":material/stacked_line_chart:", url_path="unit"),
    st.Page("views/bundle.py", title="Bundle", icon=":material/download:", url_path="bundle"),
])
page.run()
