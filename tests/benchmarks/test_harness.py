"""The shared benchmark harness: timers, the result row and its writer, every benchmark script's CLI, and the split
of benchmarks/ into maintained tools (each feeding a section of BENCHMARKS.md) and one-off experiments."""
import ast
import importlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import harness as H
from tests.docs import docs_support as ds

ROOT = Path(__file__).resolve().parents[2]


def _modules(folder: Path) -> list[str]:
    return sorted(".".join(p.relative_to(ROOT).with_suffix("").parts) for p in folder.glob("*.py")
                  if p.stem != "__init__")


# the maintained tools (benchmarks/) and the one-off experiments (benchmarks/experiments/)
TOOLS = _modules(ROOT / "benchmarks")
EXPERIMENTS = _modules(ROOT / "benchmarks" / "experiments")
LIBRARIES = ("benchmarks.harness", "benchmarks.shape_plans")     # tools the scripts share, not scripts themselves
SCRIPTS = [m for m in TOOLS if m not in LIBRARIES] + EXPERIMENTS


# ---- statistics ------------------------------------------------------------------------------------------------
def test_timing_summary_of_known_samples():
    t = H.Timing.of([5.0, 1.0, 4.0, 2.0, 3.0], "ms")
    assert (t.median, t.p10, t.p90, t.q1, t.q3, t.iqr, t.n, t.unit) == (3.0, 1.0, 5.0, 2.0, 4.0, 2.0, 5, "ms")
    assert H.percentile(list(range(1, 11)), 0.9) == 9 and H.percentile(list(range(1, 11)), 0.1) == 1
    with pytest.raises(ValueError, match="no values"):
        H.percentile([], 0.5)
    with pytest.raises(ValueError, match="unknown unit"):
        H.Timing.of([1.0], "minutes")


# ---- CPU interleaved timer -------------------------------------------------------------------------------------
def test_time_cpu_orders_a_2ms_sleep_above_a_no_op():
    cmp = H.time_cpu({"sleep 2 ms": lambda: time.sleep(0.002), "no-op": lambda: 7}, repeats=9, unit="ms")
    slow, fast = cmp.timings["sleep 2 ms"], cmp.timings["no-op"]
    assert cmp.baseline == "sleep 2 ms" and slow.n == fast.n == 9 and slow.unit == "ms"
    assert slow.median >= 2.0 and fast.median < 1.0
    assert cmp.ratio("no-op") > 5 and cmp.ratio("sleep 2 ms") == 1.0
    assert slow.iqr >= 0 and cmp.outputs["no-op"] == 7
    assert "no-op" in cmp.table() and "sleep 2 ms" in cmp.table()


def test_time_cpu_alternates_the_order_between_rounds():
    calls = []
    H.time_cpu({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3, warmup=1)
    assert calls == ["a", "b"] + ["a", "b", "b", "a", "a", "b"]


def test_time_cpu_rejects_bad_input():
    with pytest.raises(ValueError, match="baseline 'c'"):
        H.time_cpu({"a": lambda: 0}, baseline="c")
    with pytest.raises(ValueError, match="at least one"):
        H.time_cpu({})


# ---- the graph timer's and the bandwidth probe's host paths (CPU device) ---------------------------------------
class _Clock:
    """The harness's host clock (``H.time``) reading the given times in order: timings with known answers."""

    def __init__(self, *times: float):
        self.times = list(times)

    def perf_counter(self) -> float:
        return self.times.pop(0)


def test_time_graph_on_cpu_divides_by_calls_per_replay():
    t = H.time_graph(lambda: [time.sleep(0.001) for _ in range(4)], reps=5, per_replay=4, device="cpu")
    assert t.unit == "us" and t.n == 5
    assert 1000 <= t.median < 20000          # ≥ 1 ms per call, each replay is 4 calls


def test_time_graph_on_cpu_of_known_replay_times(monkeypatch):
    """Replays of 0.5, 1.5 and 1.0 s, 4 calls each: 125,000 / 375,000 / 250,000 µs per call."""
    calls = []
    clock = _Clock(0.0, 0.5, 1.0, 2.5, 4.0, 5.0)
    monkeypatch.setattr(H, "time", clock)
    t = H.time_graph(lambda: calls.append(1), reps=3, per_replay=4, device="cpu")
    assert (t.median, t.p10, t.p90, t.n, t.unit) == (250_000.0, 125_000.0, 375_000.0, 3, "us")
    assert len(calls) == 1 + 3 and clock.times == []                 # one untimed call, then each rep timed once


def test_copy_bandwidth_counts_bytes_read_and_written_over_the_median_copy(monkeypatch):
    """Copies of 0.5, 1.5 and 1.0 s of a 1 MiB buffer: 2 MiB moved in the median second."""
    n = 1 << 20
    clock = _Clock(0.0, 0.5, 1.0, 2.5, 4.0, 5.0)
    monkeypatch.setattr(H, "time", clock)
    assert H.copy_bandwidth(n, reps=3, warmup=2, device="cpu") == 2 * n / 1.0 / 1e9
    assert clock.times == []                                          # the warm-up copies are not timed


def test_copy_bandwidth_on_cpu_is_no_faster_than_the_fastest_copy():
    """The real probe against this test's own copies of the same size (bytes read and written, 2n): the probe's
    median cannot beat the fastest copy timed here, before or after it (on a shared 2-core machine its median
    came out at 0.45-0.9 of that)."""
    import torch

    n = 16 << 20

    def fastest(k: int = 8) -> float:
        # fresh buffers each time, as the probe allocates its own (a copy between buffers allocated once at the
        # start of the test once ran at a fifth of the probe's rate)
        src = torch.randint(0, 255, (n,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)
        ts = []
        for _ in range(k):
            t0 = time.perf_counter()
            dst.copy_(src)
            ts.append(time.perf_counter() - t0)
        return 2 * n / min(ts) / 1e9

    # interleaved rounds, so that a shift of the shared machine's speed during the test hits both
    probes, own = [], [fastest()]
    for _ in range(3):
        probes.append(H.copy_bandwidth(n, reps=5, warmup=1, device="cpu"))
        own.append(fastest())
    assert 0 < min(probes) <= 1.5 * max(own), (probes, own)


# ---- the row schema and the writer -----------------------------------------------------------------------------
def test_row_derives_bandwidth_from_bytes_and_time():
    r = H.Row.measured("kernels", "triton_fused", H.Timing.of([10.0, 10.0, 12.0]), nbytes=2_000_000,
                       copy_bw_gbps=400.0, shape="llama2-7b", dtype="fp16", batch=1, device="GPU X")
    assert (r.median, r.p10, r.p90, r.unit) == (10.0, 10.0, 12.0, "us")
    assert r.bytes == 2_000_000 and r.gbps == 200.0 and r.frac_copy_bw == 0.5
    ms = H.Row.measured("decode", "dense", unit="ms", median=4.0, p90=4.5, nbytes=8e9, copy_bw_gbps=4000.0)
    assert ms.gbps == 2000.0 and ms.frac_copy_bw == 0.5 and ms.p10 is None
    with pytest.raises(ValueError, match="unknown unit"):
        H.Row("x", "y", unit="min")


def test_rows_round_trip_through_the_writer(tmp_path):
    rows = [H.Row.measured("kernels", "dense", H.Timing.of([80.0, 81.0, 79.5]), nbytes=270_593_024,
                           copy_bw_gbps=4215.0, shape="llama2-7b", dtype="fp16", batch=1, device="GPU X",
                           extra={"sparsity": 0.0, "d": 4096, "D": 11008}),
            H.Row("svd-fit", "all layers", unit="s", median=38.9, batch=None, extra={"cpu_s": 70.1})]
    path = H.write_results(tmp_path / "sub" / "bench.json", rows, command="python -m benchmarks.kernels --quick",
                           device="cpu", meta={"copy_bw_gbps": 4215.0}, sections={"profile": [{"us": 4.5}]})
    assert path == tmp_path / "sub" / "bench.json"
    doc = json.loads(path.read_text())
    assert set(doc) == {"meta", "rows", "profile"} and doc["profile"] == [{"us": 4.5}]
    meta = doc["meta"]
    assert {"machine", "cpu_model", "cpu_flags", "isa", "torch", "triton", "date", "command",
            "copy_bw_gbps"} <= set(meta)
    assert meta["command"] == "python -m benchmarks.kernels --quick" and meta["torch"] == torch.__version__
    assert meta["copy_bw_gbps"] == 4215.0 and meta["machine"]["cpus"] == os.cpu_count()
    assert doc["rows"][0]["median"] == 80.0 and doc["rows"][0]["gbps"] == round(270_593_024 / 80e-6 / 1e9, 1)
    got_meta, got = H.read_results(path)
    assert got == rows and got_meta == meta


def test_results_and_the_header_line_say_which_cpu_ran_them(tmp_path, monkeypatch):
    """Every result file records the CPU it ran on (``kernels.isa.cpu_info``: the model, the feature flags the
    kernels branch on, the instruction set the native kernels are built for), a GPU run's too (its host); the header
    line scripts print names the same. The instruction set follows ``CTXSPARSE_CPU_ISA``."""
    from kernels.isa import cpu_info, resolved

    for isa in ("native", "scalar"):
        monkeypatch.setenv("CTXSPARSE_CPU_ISA", isa)
        ci = cpu_info()
        assert ci["cpu_model"] and ci["isa"] == ("scalar" if isa == "scalar" else resolved("native"))
        for device in ("cpu", "cuda"):
            meta = json.loads(H.write_results(tmp_path / f"{device}.json", [], command="test", device=device)
                              .read_text())["meta"]
            assert {k: meta[k] for k in ("cpu_model", "cpu_flags", "isa")} == ci
        want = f"{ci['cpu_model']} (flags {ci['cpu_flags'] or '-'}; native kernels built for {ci['isa']})"
        assert H.device_line("cpu") == f"device cpu: {want}"
        if torch.cuda.is_available():
            assert H.device_line("cuda") == f"device {torch.cuda.get_device_name(0)}; host cpu: {want}"
        else:
            assert H.device_line("cuda") == f"device cpu: {want}"


def test_writer_puts_bare_names_under_results_and_rejects_unknown_fields(tmp_path):
    assert H.result_path("run1.json") == H.RESULTS_DIR / "run1.json"
    assert H.result_path("run1") == H.RESULTS_DIR / "run1.json"
    assert H.result_path(tmp_path / "a.json") == tmp_path / "a.json"
    assert H.RESULTS_DIR == ROOT / "benchmarks" / "results"
    with pytest.raises(ValueError, match="not Row fields"):
        H.write_results(tmp_path / "bad.json", [{"bench": "k", "op": "x", "us_median": 3.0}])
    assert not (tmp_path / "bad.json").exists()


def test_harness_rows_load_into_the_store(tmp_path):
    from db import queries
    from db.engine import get_engine, session_scope
    from orchestrator.ingest import ingest_kernel_results

    extra = dict(device_type="cuda", d=4096, D=11008, k=5504)
    rows = [H.Row.measured("kernels", "dense", H.Timing.of([80.0, 80.0, 81.0]), shape="llama2-7b", dtype="fp16",
                           batch=1, device="GPU X", extra=dict(extra, sparsity=0.0)),
            H.Row.measured("kernels", "triton_fused", unit="ms", median=0.038, p90=0.0385, shape="llama2-7b",
                           dtype="fp16", batch=1, device="GPU X", extra=dict(extra, sparsity=0.5))]
    path = H.write_results(tmp_path / "k.json", rows, command="test", device="cpu")
    url = f"sqlite:///{tmp_path / 'k.db'}"
    assert ingest_kernel_results(path, url) == (2, 2)
    with session_scope(get_engine(url)) as s:
        lat = {r.runtime: r for r in queries.latency_table(s)}
    assert set(lat) == {"kernel:dense", "kernel:triton_fused"}
    assert lat["kernel:dense"].p50_ms_per_token == pytest.approx(0.08)
    assert lat["kernel:triton_fused"].p50_ms_per_token == pytest.approx(0.038)
    assert lat["kernel:triton_fused"].p90_ms_per_token == pytest.approx(0.0385)
    assert lat["kernel:triton_fused"].realized_sparsity == 0.5 and lat["kernel:dense"].accelerator_name == "GPU X"


# ---- every benchmark script: --help without a GPU, and no service-side imports ---------------------------------
def test_the_known_scripts_are_all_found():
    assert {"benchmarks.kernels", "benchmarks.decode", "benchmarks.experiments.svd", "benchmarks.experiments.dejavu",
            "benchmarks.quality"} <= set(SCRIPTS)


@pytest.mark.parametrize("module", SCRIPTS)
def test_script_main_parses_help(module, capsys):
    mod = importlib.import_module(module)
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "--help" in out


@pytest.mark.parametrize("module", ["benchmarks.kernels", "benchmarks.decode", "benchmarks.decode_attn",
                                    "benchmarks.layer_costs"])
def test_gpu_scripts_without_a_gpu_exit_2(module, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert importlib.import_module(module).main(["--json", "never.json"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert not (H.RESULTS_DIR / "never.json").exists()


def test_harness_and_gpu_scripts_import_no_service_packages():
    code = ("import sys, benchmarks.harness, benchmarks.kernels, benchmarks.decode; "
            "print(sorted(m for m in ('ray', 'pydantic', 'sqlalchemy', 'db', 'orchestrator') if m in sys.modules))")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_layer_costs_smoke_names_every_part_and_the_step(tmp_path):
    """benchmarks.layer_costs on the CPU (a tiny random Llama): a row per part with a positive time, the LM head,
    and the dense step with each glue (and the kernel glue with the O projection through the down kernel) beside
    its parts' sum."""
    from benchmarks import layer_costs

    out = tmp_path / "lc.json"
    assert layer_costs.main(["--smoke", "--json", str(out)]) == 0
    meta, rows = H.read_results(out)
    names = {r.op for r in rows}
    assert {"add + norm, glue torch", "add + norm, glue kernel", "qkv", "attention, glue torch",
            "attention, glue kernel", "o", "o, down kernel", "ffn dense", "ffn s=0.5", "ffn s=0.9",
            "mlp predictor + top-k", "lm head + argmax (per step)"} <= names
    assert all(r.median > 0 for r in rows)
    assert all(meta[f"step_us_glue_{g}_o_{o}"] > 0 for g, o in (("torch", "torch"), ("kernel", "torch"),
                                                                 ("kernel", "kernel")))


# ---- tools and experiments: each tool tied to the BENCHMARKS.md section it feeds --------------------------------
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"
HISTORY = sorted((ROOT / "benchmarks" / "results").glob("history-*.md"))
# modules that history files name as gone (kept there as the record of what ran)
GONE = {"benchmarks.generation_stop"}


def _docstring(module: str) -> str:
    return ast.get_docstring(ast.parse(ROOT.joinpath(*module.split(".")).with_suffix(".py").read_text())) or ""


def _labelled(module: str, label: str) -> str | None:
    """The line of the module's docstring that starts with ``label:``, with the lines after it up to a blank one."""
    lines = _docstring(module).splitlines()
    start = next((k for k, line in enumerate(lines) if line.startswith(f"{label}:")), None)
    if start is None:
        return None
    end = next((k for k in range(start, len(lines)) if not lines[k].strip()), len(lines))
    return " ".join(" ".join(lines[start:end]).split())


def _feeds(module: str) -> list[str] | None:
    """The BENCHMARKS.md sections a tool feeds: ``Feeds: BENCHMARKS.md, "SECTION"[ and "SECTION"] [(note)].``"""
    text = _labelled(module, "Feeds")
    if text is None:
        return None
    assert text.startswith("Feeds: BENCHMARKS.md, "), (module, text)
    return re.findall(r'"([^"]+)"', text)


def _recorded(module: str) -> tuple[str, str] | None:
    """(history file, section) that records an experiment's answer: ``Recorded: FILE, "SECTION".``"""
    text = _labelled(module, "Recorded")
    if text is None:
        return None
    m = re.fullmatch(r'Recorded: (benchmarks/results/[\w-]+\.md), "([^"]+)"\.?', text)
    assert m, (module, text)
    return m.group(1), m.group(2)


def _headings(path: Path) -> list[tuple[int, int, str]]:
    """(line index, level, title) of every heading of a markdown file, fenced blocks aside."""
    out, fence = [], False
    for n, line in enumerate(path.read_text().splitlines()):
        if line.lstrip().startswith(("```", "~~~")):
            fence = not fence
        elif not fence and (m := re.match(r"(#{1,6})\s+(.*?)\s*$", line)):
            out.append((n, len(m.group(1)), m.group(2)))
    return out


def _sections(path: Path) -> dict[str, str]:
    """{title: text up to the next heading of its level or above} of a markdown file, whitespace collapsed."""
    lines, heads = path.read_text().splitlines(), _headings(path)
    out = {}
    for i, (n, level, title) in enumerate(heads):
        end = next((k for k, lv, _ in heads[i + 1:] if lv <= level), len(lines))
        out.setdefault(title, " ".join(" ".join(lines[n + 1:end]).split()))
    return out


def _current_sections() -> list[str]:
    """The titles of the sections under BENCHMARKS.md's "Current figures"."""
    heads = _headings(BENCHMARKS_MD)
    k = next(i for i, (_, level, title) in enumerate(heads) if level == 2 and title == "Current figures")
    out = []
    for _, level, title in heads[k + 1:]:
        if level <= 2:
            break
        if level == 3:
            out.append(title)
    return out


def _names(text: str, module: str) -> bool:
    """``text`` names the module: ``benchmarks.NAME`` (a command or a name) or its file ``benchmarks/NAME.py``."""
    return re.search(rf"{re.escape(module)}\b|{re.escape(module.replace('.', '/'))}\.py", text) is not None


def _commands(text: str) -> set[str]:
    """The modules of the ``python -m benchmarks...`` commands in ``text``, placeholders (``NAME``, ``<name>``)
    left out."""
    mods = re.findall(r"python3?\s+-m\s+(benchmarks(?:\.[\w<>]+)*)", text)
    return {m for m in mods if not re.search(r"[<>A-Z]", m)}


def test_tools_and_experiments_are_found():
    assert {"benchmarks.harness", "benchmarks.cpu_peer", "benchmarks.quant_sparse_layers", "benchmarks.decode",
            "benchmarks.kernels"} <= set(TOOLS)
    assert {"benchmarks.experiments.svd", "benchmarks.experiments.lambada_copy"} <= set(EXPERIMENTS)
    in_tree = {".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "benchmarks").rglob("*.py")
               if p.stem != "__init__" and "__pycache__" not in p.parts}
    assert in_tree == set(TOOLS) | set(EXPERIMENTS)          # no script in a third place


def test_every_tool_feeds_a_section_of_benchmarks_md_that_names_it():
    """A tool's docstring names the BENCHMARKS.md sections it feeds; each exists and names the tool's command (or,
    for the tools the others share, its file)."""
    sections, errors = _sections(BENCHMARKS_MD), []
    for module in TOOLS:
        feeds = _feeds(module)
        if not feeds:
            errors.append(f'{module}: no `Feeds: BENCHMARKS.md, "SECTION"` in its docstring (a one-off experiment '
                          "belongs in benchmarks/experiments/)")
        for title in feeds or ():
            if title not in sections:
                errors.append(f"{module}: BENCHMARKS.md has no section {title!r}")
            elif not _names(sections[title], module):
                errors.append(f"{module}: BENCHMARKS.md, {title!r} does not name it")
    assert not errors, "\n".join(errors)


def test_the_current_figures_come_from_tools_that_say_they_feed_them():
    """Every command in a section under "Current figures" runs a tool (not an experiment), and that tool's Feeds
    line names the section."""
    sections, errors = _sections(BENCHMARKS_MD), []
    titles = _current_sections()
    assert len(titles) >= 8
    for title in titles:
        for module in sorted(_commands(sections[title])):
            if module not in TOOLS:
                errors.append(f"BENCHMARKS.md, {title!r}: `python -m {module}` is not a tool of benchmarks/")
            elif title not in (_feeds(module) or ()):
                errors.append(f"BENCHMARKS.md, {title!r}: {module}'s Feeds line does not name this section")
    assert not errors, "\n".join(errors)


def test_every_experiment_is_under_experiments_and_recorded_in_a_history_file():
    """An experiment feeds no current figure: it lives in benchmarks/experiments/ and names the history section
    that records its answer; a tool names none."""
    errors = [f"{m}: a `Recorded:` line (an experiment's): move it to benchmarks/experiments/" for m in TOOLS
              if _recorded(m) is not None]
    for module in EXPERIMENTS:
        if _feeds(module) is not None:
            errors.append(f"{module}: an experiment with a Feeds line (a tool belongs in benchmarks/)")
        rec = _recorded(module)
        if rec is None:
            errors.append(f'{module}: no `Recorded: benchmarks/results/history-….md, "SECTION"` in its docstring')
            continue
        path = ROOT / rec[0]
        if not path.is_file():
            errors.append(f"{module}: no file {rec[0]}")
        elif not any(title.startswith(rec[1]) for _, _, title in _headings(path)):
            errors.append(f"{module}: {rec[0]} has no section {rec[1]!r}")
    assert not errors, "\n".join(errors)


def test_every_benchmarks_command_in_the_documents_names_a_module():
    """``python -m benchmarks.X`` in BENCHMARKS.md, README.md, docs/ and the history files names a module of the
    tree, as do the ``benchmarks.X`` names and ``benchmarks/X.py`` files of the first three."""
    current = [BENCHMARKS_MD, *ds.doc_files()]
    errors = []
    for path in current + HISTORY:
        text = path.read_text()
        where = path.relative_to(ROOT)
        for module in sorted(_commands(text) - GONE):
            if ds.module_file(module) is None or ds.module_file(module).name == "__init__.py":
                errors.append(f"{where}: `python -m {module}`: no such module")
        if path not in current:
            continue
        for name in sorted(set(re.findall(r"`(benchmarks\.[\w.]*\w)", text))):
            if (why := ds.resolve_dotted(name)) is not None:
                errors.append(f"{where}: `{name}`: {why}")
        for file in sorted(set(re.findall(r"(?<![\w/.])benchmarks/[\w/]+\.py", text))):
            if not (ROOT / file).is_file():
                errors.append(f"{where}: {file}: no such file")
    assert not errors, "\n".join(errors)
    assert all(ds.module_file(m) is None for m in GONE)      # a module back in the tree leaves this list

