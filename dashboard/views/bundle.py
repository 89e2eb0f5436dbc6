"""Bundle: the chosen setting's predictor bundle: manifest, files, and a checked .tar.gz download."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import data
from dashboard.widgets import pick_setting, require_store

url = data.db_url()
st.title("Bundle")
require_store(url)

model, setting = pick_setting(url, "bundle")

check = data.check_bundle(url, setting.fit_unit)
if not check.files:
    st.info(f"No bundle files recorded for {setting.label} (fit unit `{setting.fit_unit[:12]}` is "
            f"{setting.status}).")
    st.stop()

st.dataframe(pd.DataFrame([{"file": a.uri.rsplit("/", 1)[-1], "bytes": a.size_bytes, "sha256": a.sha256,
                            "path": a.uri} for a in check.files]), hide_index=True, width="stretch")
if check.problems:
    st.error("The bundle on disk does not match what the store recorded; no download:\n\n"
             + "\n".join(f"- {p}" for p in check.problems))
else:
    st.download_button(
        "Download bundle (.tar.gz)", type="primary", icon=":material/download:",
        data=lambda: data.bundle_archive(url, setting.fit_unit),
        file_name=data.archive_name(url, model.id, setting.fit_unit), mime="application/gzip",
        help="every file checked against its recorded sha256 first", key="bundle_download")
    st.caption("Apply it to the same model (its fingerprint is checked):")
    st.code(f"tar xzf {data.archive_name(url, model.id, setting.fit_unit)}\n"
            "from workers.sparsity.bundle import apply_bundle\n"
            f"applied = apply_bundle(model, \"{check.name}\")   # .revert() undoes it", language="python")

if check.manifest is not None:
    m = check.manifest
    st.subheader("Manifest")
    c1, c2, c3, c4 = st.columns(4)
    c1.metric("method", str(m.get("method", "?")))
    c2.metric("sparsity", str(m.get("sparsity", "-")))
    c3.metric("rank", str(m.get("rank") if m.get("rank") is not None else "-"))
    c4.metric("model", str((m.get("model") or {}).get("ref", "?")))
    st.json(m, expanded=1)
