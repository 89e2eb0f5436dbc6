"""Pareto: accuracy against latency for every setting of a model on one device type, with the front."""
from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from dashboard import data
from dashboard.widgets import model_picker, require_store

url = data.db_url()
st.title("Pareto front")
require_store(url)

c1, c2, c3, c4, c5 = st.columns([2, 2, 1, 1, 1])
with c1:
    model = model_picker(url, key="pareto_model")
if model is None:
    st.stop()
metrics = data.metrics(url, model.id)
if not metrics:
    st.info(f"{model.name} has no accuracy rows yet (its eval units have not finished).")
    st.stop()
with_rows = data.device_types_with_rows(url, model.id)
devices = with_rows + [d for d in data.DEVICE_TYPES if d not in with_rows]
with c2:
    metric = st.selectbox("Accuracy metric", metrics, key="pareto_metric")
with c3:
    device = st.selectbox("Device type", devices, key="pareto_device",
                          format_func=lambda d: d if d in with_rows else f"{d} (no latency rows)")

counts = data.thread_counts(url, model.id, device)
with c4:      # every point of a front was timed at one thread count: the largest by default (every core)
    threads = (st.selectbox("Threads" if device == "cpu" else "Host threads", counts, key="pareto_threads")
               if len(counts) > 1 else None)
builds = data.isas(url, model.id, device)
with c5:      # and under one build of the native CPU kernels: the widest by default (picked by position: None,
    # rows that record no build, is an option too)
    isa = (builds[st.selectbox("CPU build", range(len(builds)), key="pareto_isa",
                               format_func=lambda i: data.isa_label(builds[i]))]
           if len(builds) > 1 else data.DEFAULT_ISA)

fr = data.front(url, model.id, metric, device, threads, isa)
df = pd.DataFrame(data.front_records(fr))
y_title = f"{metric} ({fr.direction} is better)"      # the direction stored with the metric's rows
if fr.accelerator:
    how = data.where_label(fr.device_type, fr.threads, fr.isa)     # threads and build: CPU notions only
    st.caption(f"p50 ms per token on {fr.device_type} · {fr.accelerator} · batch {fr.batch} · "
               f"prompt {fr.prompt_len} tokens{f' · timed at {how}' if how else ''}; the front: settings "
               f"no other setting beats on both axes (latencies within {data.LATENCY_TIE:.0%} count as equal).")
if fr.other_isas:
    st.caption("Also timed under " + ", ".join(data.isa_label(i) for i in fr.other_isas) +
               ": not drawn here (each build is a front of its own; pick it under CPU build).")
if fr.message:
    st.warning(f"No Pareto front for {model.name} on {device}: {fr.message}.")

tooltip = [alt.Tooltip("setting:N"), alt.Tooltip("method:N"), alt.Tooltip("s:Q", format=".2f"),
           alt.Tooltip("r:Q"), alt.Tooltip("accuracy:Q", title=metric, format=".4g"),
           alt.Tooltip("latency_ms:Q", title="p50 ms/token", format=".3f"),
           alt.Tooltip("realized_sparsity:Q", title="decoder weights skipped", format=".3f"),
           alt.Tooltip("speedup:Q", format=".2f"), alt.Tooltip("spread:N", title="speedup spread"),
           alt.Tooltip("on_front:N", title="on front")]
color = alt.Color("method:N", title="method", scale=alt.Scale(scheme="tableau10"))
timed = df[df["latency_ms"].notna()] if not df.empty else df


def y_axis(plotted: pd.DataFrame, **scale) -> alt.Y:
    """The metric's axis; logarithmic for a perplexity whose plotted values span more than LOG_SPAN×."""
    log = data.log_axis(metric, plotted["accuracy"])
    if log:
        scale["type"] = "log"
    return alt.Y("accuracy:Q", title=y_title + (" (log scale)" if log else ""), scale=alt.Scale(zero=False, **scale))


if not timed.empty:
    y = y_axis(timed, padding=24, reverse=fr.direction == "lower")
    base = alt.Chart(timed)
    x = alt.X("latency_ms:Q", title=f"p50 ms per token ({device})", scale=alt.Scale(zero=False, padding=24))
    points = base.mark_point(size=110, filled=True, opacity=0.9).encode(x=x, y=y, color=color, tooltip=tooltip)
    line = alt.Chart(timed[timed["on_front"]].sort_values("latency_ms")).mark_line(
        color="black", strokeDash=[5, 3], point=alt.OverlayMarkDef(color="black", size=25)).encode(
        x=x, y=y, order="latency_ms:Q", tooltip=tooltip)
    dense = base.transform_filter(alt.datum.dense)
    dense_ring = dense.mark_point(shape="diamond", size=420, filled=False, color="black", strokeWidth=1.5).encode(
        x=x, y=y, tooltip=tooltip)
    dense_label = dense.mark_text(align="left", dx=13, dy=-11, fontWeight="bold").encode(
        x=x, y=y, text=alt.value("dense baseline"))
    st.altair_chart((line + points + dense_ring + dense_label).properties(height=430).interactive(),
                    width="stretch")
    st.caption("Dashed black line: the Pareto front. Black diamond: the dense baseline.")
elif not df.empty:
    st.caption("Accuracy only (no latency rows for this device type):")
    bars = alt.Chart(df).mark_bar().encode(
        x=alt.X("setting:N", sort=None, title="setting"), y=y_axis(df), color=color, tooltip=tooltip)
    st.altair_chart(bars.properties(height=330), width="stretch")

columns = ["setting", "method", "s", "r", "accuracy", "latency_ms", "speedup", "spread", "realized_sparsity",
           "accelerator", "threads", "isa", "weights", "note", "fit_unit"]
config = {"accuracy": st.column_config.NumberColumn(metric, format="%.4g"),
          "latency_ms": st.column_config.NumberColumn("p50 ms/token", format="%.3f"),
          "speedup": st.column_config.NumberColumn("speedup vs dense", format="%.2fx"),
          "spread": st.column_config.TextColumn("speedup spread (repeats)"),
          "realized_sparsity": st.column_config.NumberColumn("weights skipped", format="%.3f"),
          "s": st.column_config.NumberColumn("s", format="%.2f"),
          "weights": st.column_config.TextColumn("weights decoded"),
          "isa": st.column_config.TextColumn("CPU build")}
st.subheader("Front")
front = df[df["on_front"]] if not df.empty else df
if front.empty:
    st.info("No setting is on a front here (no latency rows for this device type).")
else:
    st.dataframe(front[columns], hide_index=True, width="stretch", column_config=config, key="front_table")

baselines = data.baseline_records(fr)
if baselines:
    st.subheader("Baselines")
    st.caption("Timed on the dense setting at the front's point, never on the front: llama.cpp on the model's GGUF "
               "(beside our dense decode, placed at dense's time over that speedup), Hugging Face generate (alone).")
    st.dataframe(pd.DataFrame(baselines), hide_index=True, width="stretch", key="baselines_table",
                 column_config={"latency_ms": config["latency_ms"], "speedup": config["speedup"]})

st.subheader("All settings")
picked = st.dataframe(df[columns + ["on_front"]], hide_index=True, width="stretch", column_config=config,
                      on_select="rerun", selection_mode="single-row", key="all_table")
rows = picked.selection.rows if picked is not None else []
if rows:
    fit_unit = df.iloc[rows[0]]["fit_unit"]
    st.session_state["fit_unit"] = fit_unit
    c1, c2 = st.columns(2)
    c1.page_link("views/unit.py", label=f"Per-layer diagnostics of {df.iloc[rows[0]]['setting']}",
                 icon=":material/stacked_line_chart:")
    c2.page_link("views/bundle.py", label="Its bundle", icon=":material/download:")
else:
    st.caption("Select a row to open that setting's diagnostics or bundle.")
