import json
from pathlib import Path

import pytest

from db import queries
from db.engine import get_engine, session_scope
from orchestrator.cli import main
from orchestrator.ingest import IngestError, ingest_kernel_results

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "h200_2026-11-29.json"


def test_kernel_results_load_once_with_every_row(tmp_path):
    url = f"sqlite:///{tmp_path / 'k.db'}"
    rows = json.loads(RESULTS.read_text())["rows"]
    assert ingest_kernel_results(RESULTS, url) == (len(rows), len(rows))
    assert ingest_kernel_results(RESULTS, url) == (len(rows), 0)          # idempotent
    with session_scope(get_engine(url)) as s:
        lat = queries.latency_table(s, runtime="kernel:dense")
        assert {r.accelerator_name for r in lat} == {"NVIDIA H200"}
        src = {(r["shape"], r["dtype"], r["batch"], r["sparsity"]): r["us_median"]
               for r in rows if r["variant"] == "dense"}
        assert len(lat) == len(src)
        got = sorted(round(r.p50_ms_per_token * 1000, 3) for r in lat)
        assert got == sorted(round(v, 3) for v in src.values())
        assert len(queries.latency_table(s)) == len(rows)


def test_malformed_file_is_a_clear_error_and_writes_nothing(tmp_path):
    url = f"sqlite:///{tmp_path / 'k.db'}"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": [{"shape": "x"}]}))
    with pytest.raises(IngestError, match="row 0 lacks"):
        ingest_kernel_results(bad, url)
    assert not (tmp_path / "k.db").exists()
    (tmp_path / "trunc.json").write_text('{"rows": [')
    assert main(["ingest-kernels", str(tmp_path / "trunc.json"), "--db", url]) == 2


def test_kernel_rows_and_sweep_units_of_a_shape_share_one_model(tmp_path):
    """Both take the identity from workers.names.shape_identity: the dashboard then joins their rows."""
    from workers.units import Units

    url = f"sqlite:///{tmp_path / 'k.db'}"
    row = {"device_type": "cuda", "accelerator_name": "NVIDIA H200", "shape": "llama2-7b", "d": 4096, "D": 11008,
           "dtype": "fp16", "batch": 1, "sparsity": 0.5, "variant": "triton_fused", "us_median": 50.0, "us_p90": 55.0}
    f = tmp_path / "rows.json"
    f.write_text(json.dumps({"rows": [row]}))
    assert ingest_kernel_results(f, url) == (1, 1)
    d = Units().describe("shape:llama2-7b", {}, None)          # what a sweep registers for the shape
    with session_scope(get_engine(url)) as s:
        (m,) = queries.list_models(s)
        assert (m.name, m.fingerprint) == (d["name"], d["fingerprint"])
        assert m.name == "llama2-7b-shape"
        assert queries.upsert_model(s, name=d["name"], fingerprint=d["fingerprint"]) == m.id
