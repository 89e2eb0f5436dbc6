"""Overview: models, sweeps, progress, failures with their error text."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import data
from dashboard.widgets import require_store

url = data.db_url()
st.title("ctxsparse")
st.caption("Contextual-sparsity sweeps: models, sweeps and their progress.")
require_store(url)

models = data.models(url)
sweeps = data.sweeps(url)
done = sum(s.done for s in sweeps)
total = sum(s.total for s in sweeps)
failed = sum(s.failed for s in sweeps)
c1, c2, c3, c4 = st.columns(4)
c1.metric("Models", len(models))
c2.metric("Sweeps", len(sweeps))
c3.metric("Sweep units done", f"{done} / {total}", help="summed over sweeps (a unit shared by two sweeps counts twice)")
c4.metric("Sweep units failed", failed)

st.subheader("Models")
if models:
    st.dataframe(pd.DataFrame([{
        "model": m.name, "family": m.family, "parameters": m.n_params, "fingerprint": m.fingerprint[:16],
        "settings": len(data.settings(url, m.id)), "added": m.created_at,
    } for m in models]), hide_index=True, width="stretch")
else:
    st.info("No models yet.")

st.subheader("Sweeps")
if not sweeps:
    st.info("No sweeps yet.")
else:
    st.dataframe(pd.DataFrame([{
        "id": s.info.id, "name": s.info.name, "status": s.info.status, "progress": s.fraction,
        "done": s.done, "failed": s.failed, "total": s.total, "created": s.info.created_at,
        "finished": s.info.finished_at, "spec hash": s.info.spec_hash[:12],
    } for s in sweeps]), hide_index=True, width="stretch",
        column_config={"progress": st.column_config.ProgressColumn("progress", min_value=0.0, max_value=1.0,
                                                                   format="percent")})
    for s in sweeps:
        with st.expander(f"Sweep {s.info.id} · {s.info.name}: spec"):
            st.json(s.info.spec, expanded=False)

    st.subheader("Failures")
    failing = [s for s in sweeps if s.failures]
    if not failing:
        st.success("No failed units.")
    for s in failing:
        st.markdown(f"**Sweep {s.info.id} · {s.info.name}**: {len(s.failures)} failed unit(s)")
        for f in s.failures:
            last = (f.error.strip().splitlines() or ["(no error text)"])[-1]
            with st.expander(f"{f.kind} {f.what} · {f.id[:12]} · attempts {f.attempts}: {last[:120]}"):
                st.caption(f"unit {f.id} on worker {f.worker or '?'}")
                st.code(f.error or "(no error text)", language="text")
