"""Unit: one setting (its fit unit): per-layer quality, latency breakdown, the config that produced it."""
from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from dashboard import data
from dashboard.widgets import pick_setting, require_store

url = data.db_url()
st.title("Setting diagnostics")
require_store(url)

model, setting = pick_setting(url, "unit")
info = data.unit(url, setting.fit_unit)

st.subheader(setting.label)
c1, c2, c3, c4 = st.columns(4)
c1.metric("status", setting.status)
c2.metric("decoder weights skipped", "-" if setting.realized_sparsity is None else f"{setting.realized_sparsity:.3f}")
c3.metric("fit time", "-" if info is None or info.duration_s is None else f"{info.duration_s:.1f} s")
c4.metric("evaluations", len(setting.eval_units))
st.caption(f"fit unit `{setting.fit_unit}`")
if info is not None and info.error:
    st.error("Last attempt failed:")
    st.code(info.error, language="text")

acc_rows = data.accuracy_vs_dense(url, model.id, setting.fit_unit)
if acc_rows:
    st.markdown("**Accuracy**" + ("" if setting.is_dense else " beside dense"))
    adf = pd.DataFrame(acc_rows)
    if setting.is_dense or adf["dense"].isna().all():
        adf = adf[["metric", "value", "stderr", "n"]]
    else:
        adf["beyond_noise"] = adf["beyond_noise"].map({True: "✱ yes", False: "no"}).fillna("?")
        st.caption(f"✱: the difference from dense is larger than noise, |a − b| > {data.NOISE_K:g}·√(se_a² + se_b²) "
                   "(each row's standard error); ?: a standard error is missing.")
    num = st.column_config.NumberColumn(format="%.4g")
    st.dataframe(adf, hide_index=True, column_config={c: num for c in ("value", "stderr", "dense", "dense_stderr",
                                                                        "diff")})

# ---------------------------------------------------------------- per layer
st.subheader("Per layer")
layer_rows = data.layers(url, setting.fit_unit)
if not layer_rows:
    st.info("No per-layer rows: " + ("the dense setting skips nothing." if setting.is_dense
                                     else "the fit unit has not finished."))
else:
    ldf = pd.DataFrame([r.model_dump() for r in layer_rows])
    x = alt.X("layer:O", title="layer")
    color = alt.Color("component:N", title="component")
    tip = ["component:N", "layer:O", alt.Tooltip("recall:Q", format=".3f"),
           alt.Tooltip("precision:Q", format=".3f"), alt.Tooltip("realized_sparsity:Q", format=".3f"),
           alt.Tooltip("target_sparsity:Q", format=".3f"), alt.Tooltip("auc:Q", format=".3f"),
           alt.Tooltip("threshold:Q", format=".4g")]
    c1, c2 = st.columns(2)
    with c1:
        st.markdown("**Recall** (share of truly active units kept)")
        st.altair_chart(alt.Chart(ldf).mark_line(point=True).encode(
            x=x, y=alt.Y("recall:Q", scale=alt.Scale(domain=[0, 1])), color=color, tooltip=tip
        ).properties(height=260), width="stretch")
    with c2:
        st.markdown("**Realized sparsity** (dashed: target)")
        sp = ldf.melt(id_vars=["layer", "component"], value_vars=["realized_sparsity", "target_sparsity"],
                      var_name="kind", value_name="sparsity").dropna()
        st.altair_chart(alt.Chart(sp).mark_line(point=True).encode(
            x=x, y=alt.Y("sparsity:Q", scale=alt.Scale(domain=[0, 1])), color=color,
            strokeDash=alt.StrokeDash("kind:N", title=None), tooltip=["component:N", "layer:O", "kind:N",
                                                                     alt.Tooltip("sparsity:Q", format=".3f")]
        ).properties(height=260), width="stretch")
    th = ldf.dropna(subset=["threshold"])
    st.markdown("**Threshold** per layer")
    if th.empty:
        st.caption("This method keeps no per-layer threshold (top-k or a learned predictor).")
    else:
        st.altair_chart(alt.Chart(th).mark_bar().encode(x=x, y=alt.Y("threshold:Q"), color=color, tooltip=tip)
                        .properties(height=220), width="stretch")
    with st.expander("Per-layer rows"):
        st.dataframe(ldf.drop(columns=["unit_id"]), hide_index=True, width="stretch")

# ---------------------------------------------------------------- latency
st.subheader("Latency")
lat = data.latency_breakdown(url, model.id, setting.fit_unit)
if not lat:
    st.info("No latency rows for this setting or the dense baseline yet.")
else:
    ldf = pd.DataFrame([{
        "series": f"{who} · {r.runtime}",
        "device": data.latency_panel(r), "batch": r.batch,
        "prompt_len": r.prompt_len,
        "gen_len": r.gen_len, "runtime": r.runtime, "method": r.method, "p50_ms_per_token": r.p50_ms_per_token,
        "p90_ms_per_token": r.p90_ms_per_token, "tokens_per_s": r.tokens_per_s,
        "realized_sparsity": r.realized_sparsity, "threads": r.threads, "isa": r.isa, "cpu_flags": r.cpu_flags,
        "speedup_spread": data.spread_label(r.speedup_min, r.speedup_max), "unit": r.unit_id[:12],
    } for who, r in lat])
    chart = alt.Chart(ldf).mark_bar().encode(
        x=alt.X("prompt_len:O", title="prompt length (tokens)"),
        xOffset=alt.XOffset("series:N"),
        y=alt.Y("p50_ms_per_token:Q", title="p50 ms per token"),
        color=alt.Color("series:N", title=None),
        column=alt.Column("device:N", title=None),
        tooltip=["series:N", "device:N", "batch:O", "prompt_len:O", "runtime:N",
                 alt.Tooltip("p50_ms_per_token:Q", format=".3f"), alt.Tooltip("p90_ms_per_token:Q", format=".3f"),
                 alt.Tooltip("tokens_per_s:Q", format=".1f")]).properties(height=260, width=260)
    st.altair_chart(chart)
    st.caption("The dense rows are the reference: the dense setting in our decode runtime, `hf-generate` "
               "(the Hugging Face generate loop) and `llama.cpp` (the model's GGUF, timed beside our dense decode). "
               "`threads`: the thread count each row was measured at; `isa`: the instruction set the native CPU "
               "kernels were built for (`fallback`: they did not build, torch primitives ran), with the CPU's "
               "`cpu_flags`; `speedup_spread`: the lowest and highest per-repeat speedup over the dense decode "
               "timed beside it.")
    st.dataframe(ldf, hide_index=True, width="stretch")

# ---------------------------------------------------------------- provenance
st.subheader("Spec")
if info is None:
    st.info("The fit unit is not in the store.")
else:
    st.caption(f"code version `{info.code_version}` · git `{info.git_rev or '?'}` · worker `{info.worker or '?'}` · "
               f"attempts {info.attempts}")
    st.markdown("Unit config (hashed into its id):")
    st.json(info.config, expanded=2)
    for sw in data.sweeps_of(url, info.id):
        with st.expander(f"Sweep spec: {sw.name} (sweep {sw.id}, {sw.status})"):
            st.json(sw.spec, expanded=2)
    if info.package_versions:
        with st.expander("Package versions"):
            st.json(info.package_versions)
