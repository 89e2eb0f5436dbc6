"""Pickers shared by the pages (drawing only; data comes from ``dashboard.data``).

The chosen model and setting live in session state (``model_id``, ``fit_unit``) so they follow the user
from page to page; ``?unit=<fit unit id>`` in the URL selects a setting directly.
"""
from __future__ import annotations

import streamlit as st

from dashboard import data
from db.front.settings import Setting
from db.schemas import ModelInfo


def require_store(url: str) -> None:
    """Draw why the store can't be shown (and stop the page), or note that it is empty."""
    state = data.store_state(url)
    if not state.ok:
        st.warning(state.message)
        st.stop()
    if state.empty:
        st.info("The store is empty: no models and no sweeps yet. Submit a sweep (`make demo`, or "
                "`ctxsparse` / `ray job submit ... python -m orchestrator.driver spec.yaml`) and refresh.")
        st.stop()


def _model_label(m: ModelInfo) -> str:
    return f"{m.name} ({m.fingerprint[:8]})"


def model_picker(url: str, key: str) -> ModelInfo | None:
    models = data.models(url)
    if not models:
        st.info("No models in the store yet.")
        return None
    if "unit" in st.query_params:                      # a link to a setting picks its model
        u = data.unit(url, st.query_params["unit"])
        if u is not None and st.session_state.get("fit_unit") != u.id:
            st.session_state["model_id"], st.session_state["fit_unit"] = u.model_id, u.id
    ids = [m.id for m in models]
    current = st.session_state.get("model_id")
    index = ids.index(current) if current in ids else 0
    by_id = {m.id: m for m in models}
    mid = st.selectbox("Model", ids, index=index, format_func=lambda i: _model_label(by_id[i]), key=key)
    st.session_state["model_id"] = mid
    return by_id[mid]


def setting_picker(url: str, model_id: int, key: str) -> Setting | None:
    settings = data.settings(url, model_id)
    if not settings:
        st.info("This model has no fitted settings yet.")
        return None
    ids = [s.fit_unit for s in settings]
    current = st.session_state.get("fit_unit")
    index = ids.index(current) if current in ids else 0
    by_id = {s.fit_unit: s for s in settings}
    fu = st.selectbox("Setting", ids, index=index, key=key,
                      format_func=lambda k: f"{by_id[k].label}  ·  {k[:12]}  ·  {by_id[k].status}")
    s = by_id[fu]
    st.session_state["fit_unit"] = fu
    if st.query_params.get("unit") not in (None, s.fit_unit):
        st.query_params["unit"] = s.fit_unit
    return s


def pick_setting(url: str, page: str) -> tuple[ModelInfo, Setting]:
    """The model and setting pickers side by side (keys ``<page>_model`` / ``<page>_setting``); stops the page
    when there is nothing to pick."""
    c1, c2 = st.columns([1, 2])
    with c1:
        model = model_picker(url, key=f"{page}_model")
    if model is None:
        st.stop()
    with c2:
        setting = setting_picker(url, model.id, key=f"{page}_setting")
    if setting is None:
        st.stop()
    return model, setting
