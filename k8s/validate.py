"""Offline validation of our Kubernetes manifests against pinned schemas.

    validate_manifest(doc) -> list[str]      one message per problem, each naming the path
    render_kustomization(dir) -> list[dict]  what ``kubectl apply -k dir`` would send (the subset
                                             of kustomize we use: resources, namespace, images,
                                             configMapGenerator, labels)
    shared_home_problems(docs) -> list[str]  every Ray pod mounts the same ReadWriteMany claim at the
                                             CTXSPARSE_HOME its env declares (checked on the rendered
                                             kustomization: the objects deployed together)
    python -m k8s.validate k8s/              prints OK or the errors; exit status 1 on errors

Schemas (see schemas/README.md): KubeRay's RayCluster/RayJob CRD ``openAPIV3Schema`` and the
strict Kubernetes JSON schemas of the core kinds we use. The CRD schemas are made strict here
the way the API server treats them under kubectl's default ``--validate=strict``: an object
schema that lists ``properties`` rejects unknown fields unless it says
``x-kubernetes-preserve-unknown-fields``. Also checked: ``x-kubernetes-list-type: map|set``
uniqueness (duplicate container, env or port names). Not checked: CEL rules
(``x-kubernetes-validations``) and what only the operator's webhook/controller validates.
"""
from __future__ import annotations

import copy
import functools
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from jsonschema import ValidationError, validators
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SCHEMA_DIR = Path(__file__).resolve().parent / "schemas"
KUBERAY_VERSION = "v1.7.0"
KUBERNETES_VERSION = "v1.30.0"
_CORE_ID = "https://kubernetes.io/api/_definitions.json"
_CORE_KINDS = {
    ("apps/v1", "Deployment"): "io.k8s.api.apps.v1.Deployment",
    ("apps/v1", "StatefulSet"): "io.k8s.api.apps.v1.StatefulSet",
    ("batch/v1", "Job"): "io.k8s.api.batch.v1.Job",
    ("v1", "Service"): "io.k8s.api.core.v1.Service",
    ("v1", "ConfigMap"): "io.k8s.api.core.v1.ConfigMap",
    ("v1", "Secret"): "io.k8s.api.core.v1.Secret",
    ("v1", "PersistentVolumeClaim"): "io.k8s.api.core.v1.PersistentVolumeClaim",
}
_CRDS = {
    ("ray.io/v1", "RayCluster"): f"kuberay-{KUBERAY_VERSION}-raycluster.json",
    ("ray.io/v1", "RayJob"): f"kuberay-{KUBERAY_VERSION}-rayjob.json",
}
KNOWN_KINDS = sorted(f"{a} {k}" for a, k in [*_CORE_KINDS, *_CRDS])


def _list_type(validator, list_type, instance, schema):
    """``x-kubernetes-list-type``: ``map`` entries are unique by their map keys, ``set`` items unique."""
    if not isinstance(instance, list):
        return
    if list_type == "map":
        keys = schema.get("x-kubernetes-list-map-keys") or []
        seen = set()
        for item in instance:
            if isinstance(item, dict):
                key = tuple(item.get(k) for k in keys)
                if key in seen:
                    shown = ", ".join(f"{k}={v!r}" for k, v in zip(keys, key))
                    yield ValidationError(f"duplicate entry with {shown}")
                seen.add(key)
    elif list_type == "set":
        seen_s: list = []
        for item in instance:
            if item in seen_s:
                yield ValidationError(f"duplicate item {item!r}")
            seen_s.append(item)


_Validator = validators.extend(validators.Draft202012Validator, {"x-kubernetes-list-type": _list_type})


def _strict_crd(node: Any) -> Any:
    """The CRD schema as the API server applies it to our objects (see module docstring)."""
    if isinstance(node, list):
        return [_strict_crd(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict_crd(v) for k, v in node.items()}
    if "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if out.get("nullable") is True and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


@functools.cache
def _registry() -> Registry:
    core = json.loads((SCHEMA_DIR / f"kubernetes-{KUBERNETES_VERSION}-strict.json").read_text())
    return Registry().with_resource(_CORE_ID, Resource.from_contents(core, default_specification=DRAFT202012))


@functools.cache
def _validator(api_version: str, kind: str):
    key = (api_version, kind)
    if key in _CORE_KINDS:
        schema = {"$ref": f"{_CORE_ID}#/$defs/{_CORE_KINDS[key]}"}
    elif key in _CRDS:
        schema = _strict_crd(json.loads((SCHEMA_DIR / _CRDS[key]).read_text()))
        # metadata of a custom resource is validated by the API server as ObjectMeta
        schema["properties"]["metadata"] = {"$ref": f"{_CORE_ID}#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
        schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata"})
    else:
        return None
    return _Validator(schema, registry=_registry())


def _path(parts: Iterable) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(root)"


def _message(err: ValidationError) -> str:
    msg = err.message
    if err.context:  # anyOf/oneOf: say what each alternative wanted
        msg += " (" + "; ".join(sorted({c.message for c in err.context})) + ")"
    return msg if len(msg) <= 240 else msg[:237] + "..."


def validate_manifest(doc: Any) -> list[str]:
    """Schema errors of one Kubernetes object, as ``"<Kind>/<name>: <path>: <problem>"``; [] if valid."""
    if not isinstance(doc, dict):
        return [f"(document): expected a mapping (a Kubernetes object), got {type(doc).__name__}"]
    api_version, kind = doc.get("apiVersion"), doc.get("kind")
    meta = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
    label = f"{kind or '?'}/{meta.get('name') or meta.get('generateName') or '?'}"
    if not isinstance(api_version, str) or not isinstance(kind, str):
        return [f"{label}: (root): apiVersion and kind must be strings"]
    validator = _validator(api_version, kind)
    if validator is None:
        return [f"{label}: (root): no pinned schema for apiVersion {api_version!r} kind {kind!r} "
                f"(known: {', '.join(KNOWN_KINDS)})"]
    errors = sorted(validator.iter_errors(doc), key=lambda e: ([str(p) for p in e.absolute_path], e.message))
    return [f"{label}: {_path(e.absolute_path)}: {_message(e)}" for e in errors]


# ---------------------------------------------------------------- cross-object rules

HOME_ENV = "CTXSPARSE_HOME"


def _ray_groups(rc: dict) -> list[tuple[str, str, dict]]:
    """(path, group name, group spec) of the head and every worker group of a RayCluster."""
    spec = rc.get("spec") or {}
    out = [("spec.headGroupSpec", "head", spec.get("headGroupSpec") or {})]
    for i, g in enumerate(spec.get("workerGroupSpecs") or []):
        out.append((f"spec.workerGroupSpecs[{i}]", str(g.get("groupName", "?")), g))
    return out


def shared_home_problems(docs: list[dict]) -> list[str]:
    """Sweep actors exchange activations and predictor bundles through ``$CTXSPARSE_HOME``, and the driver
    (on the head) hands its ``CTXSPARSE_HOME`` to every actor. So in every RayCluster the Ray container
    (``containers[0]``) of each group must declare ``CTXSPARSE_HOME`` as a literal absolute path and mount
    there, writable and without ``subPath``, a ``persistentVolumeClaim`` volume; path and claim must be the
    same in every group, and the claim must be among ``docs`` with access mode ``ReadWriteMany``.
    One message per problem, each naming the group and the path in the object."""
    errors: list[str] = []
    pvcs = {((d.get("metadata") or {}).get("namespace"), (d.get("metadata") or {}).get("name")): d
            for d in docs if isinstance(d, dict) and d.get("kind") == "PersistentVolumeClaim"}
    for rc in docs:
        if not isinstance(rc, dict) or rc.get("kind") != "RayCluster":
            continue
        meta = rc.get("metadata") or {}
        label = f"RayCluster/{meta.get('name', '?')}"
        seen: dict[tuple, list[str]] = {}     # (home path, claim) -> groups
        for path, group, g in _ray_groups(rc):
            pod = (g.get("template") or {}).get("spec") or {}
            containers = pod.get("containers") or []
            if not containers:
                errors.append(f"{label}: {path}.template.spec ({group}): no containers")
                continue
            c = containers[0]
            cpath = f"{path}.template.spec.containers[0]"
            env = {e.get("name"): e for e in c.get("env") or [] if isinstance(e, dict)}
            if HOME_ENV not in env:
                errors.append(f"{label}: {cpath}.env ({group}): {HOME_ENV} is not set: every Ray pod needs the "
                              f"path of the shared cache")
                continue
            home = env[HOME_ENV].get("value")
            if not isinstance(home, str) or not home.startswith("/"):
                errors.append(f"{label}: {cpath}.env ({group}): {HOME_ENV} must be a literal absolute path, "
                              f"got {home!r}")
                continue
            home = home.rstrip("/") or "/"
            mounts = [(i, m) for i, m in enumerate(c.get("volumeMounts") or [])
                      if isinstance(m, dict) and str(m.get("mountPath", "")).rstrip("/") == home]
            if not mounts:
                errors.append(f"{label}: {cpath}.volumeMounts ({group}): nothing is mounted at "
                              f"{HOME_ENV}={home}: mount the shared ReadWriteMany claim there")
                continue
            i, m = mounts[0]
            mpath = f"{cpath}.volumeMounts[{i}]"
            if m.get("readOnly"):
                errors.append(f"{label}: {mpath} ({group}): {HOME_ENV} is mounted readOnly; actors write there")
            if m.get("subPath") or m.get("subPathExpr"):
                errors.append(f"{label}: {mpath} ({group}): {HOME_ENV} is mounted with a subPath; every pod must "
                              f"see the whole shared volume")
            vols = {v.get("name"): (j, v) for j, v in enumerate(pod.get("volumes") or []) if isinstance(v, dict)}
            if m.get("name") not in vols:
                errors.append(f"{label}: {mpath} ({group}): volume {m.get('name')!r} is not in the pod's volumes")
                continue
            j, vol = vols[m["name"]]
            vpath = f"{path}.template.spec.volumes[{j}]"
            src = vol.get("persistentVolumeClaim")
            if not isinstance(src, dict):
                kind = next((k for k in vol if k != "name"), "nothing")
                errors.append(f"{label}: {vpath} ({group}): volume {m['name']!r} mounted at {HOME_ENV}={home} is "
                              f"{kind}, not a persistentVolumeClaim: every Ray pod must mount the same "
                              f"ReadWriteMany claim there")
                continue
            if src.get("readOnly"):
                errors.append(f"{label}: {vpath} ({group}): claim {src.get('claimName')!r} is attached readOnly")
            seen.setdefault((home, src.get("claimName")), []).append(group)
        if len(seen) > 1:
            shown = "; ".join(f"{', '.join(gs)}: claim {c!r} at {h}" for (h, c), gs in seen.items())
            errors.append(f"{label}: the Ray pods do not share one {HOME_ENV} ({shown})")
        for (home, claim), groups in seen.items():
            pvc = pvcs.get((meta.get("namespace"), claim))
            if pvc is None:
                errors.append(f"{label}: claim {claim!r} (mounted at {HOME_ENV} by {', '.join(groups)}) is not "
                              f"defined: add its PersistentVolumeClaim to the kustomization")
                continue
            modes = (pvc.get("spec") or {}).get("accessModes") or []
            if "ReadWriteMany" not in modes:
                errors.append(f"PersistentVolumeClaim/{claim}: spec.accessModes: {modes} lacks 'ReadWriteMany' "
                              f"(Ray pods on different nodes mount it at {HOME_ENV})")
    return errors


# ---------------------------------------------------------------- files and kustomize

def load_docs(path: Path) -> list[dict]:
    """All non-empty YAML documents of a (multi-document) file."""
    return [d for d in yaml.safe_load_all(Path(path).read_text()) if d is not None]


def _image_name(image: str) -> str:
    """``registry:5000/org/name:tag@sha256:...`` -> ``registry:5000/org/name``."""
    name = image.split("@", 1)[0]
    slash = name.rfind("/")
    colon = name.rfind(":")
    return name[:colon] if colon > slash else name


def _set_image(image: str, rule: dict) -> str:
    name = rule.get("newName") or _image_name(image)
    if rule.get("digest"):
        return f"{name}@{rule['digest']}"
    rest = image[len(_image_name(image)):]
    tag = f":{rule['newTag']}" if rule.get("newTag") else rest
    return name + tag


def apply_images(node: Any, rules: list[dict]) -> None:
    """kustomize ``images:``: rewrite ``image`` of every item of any ``containers``/``initContainers``
    list anywhere in the object (custom resources included, as kustomize does)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                for c in value:
                    if isinstance(c, dict) and isinstance(c.get("image"), str):
                        for rule in rules:
                            if _image_name(c["image"]) == rule["name"]:
                                c["image"] = _set_image(c["image"], rule)
                                break
            apply_images(value, rules)
    elif isinstance(node, list):
        for v in node:
            apply_images(v, rules)


KUSTOMIZATION_KEYS = {"apiVersion", "kind", "namespace", "resources", "images", "configMapGenerator",
                      "generatorOptions", "labels"}


def kustomization_problems(kdir: Path) -> list[str]:
    """Keys we do not emulate, listed files that do not exist."""
    kdir = Path(kdir)
    k = yaml.safe_load((kdir / "kustomization.yaml").read_text())
    out = [f"kustomization.yaml: key {key!r} is not emulated by k8s/validate.py"
           for key in sorted(set(k) - KUSTOMIZATION_KEYS)]
    for res in k.get("resources", []):
        if not (kdir / res).is_file():
            out.append(f"kustomization.yaml: resources: {res!r} is not a file in {kdir.name}/")
    for gen in k.get("configMapGenerator", []):
        for f in gen.get("files", []):
            src = f.split("=", 1)[-1]
            if not (kdir / src).is_file():
                out.append(f"kustomization.yaml: configMapGenerator {gen.get('name')}: {src!r} is not a file")
        if not ((gen.get("options") or {}).get("disableNameSuffixHash")
                or (k.get("generatorOptions") or {}).get("disableNameSuffixHash")):
            out.append(f"kustomization.yaml: configMapGenerator {gen.get('name')}: name suffix hash not emulated")
    return out


def render_kustomization(kdir: Path) -> list[dict]:
    """The objects ``kubectl apply -k kdir`` would create (for our kustomization's subset)."""
    kdir = Path(kdir)
    problems = kustomization_problems(kdir)
    if problems:
        raise ValueError("; ".join(problems))
    k = yaml.safe_load((kdir / "kustomization.yaml").read_text())
    docs = [d for res in k.get("resources", []) for d in load_docs(kdir / res)]
    for gen in k.get("configMapGenerator", []):
        data = {}
        for f in gen.get("files", []):
            key, _, src = f.rpartition("=")
            data[key or Path(src).name] = (kdir / src).read_text()
        for lit in gen.get("literals", []):
            key, _, value = lit.partition("=")
            data[key] = value
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data})
    docs = copy.deepcopy(docs)
    for d in docs:
        meta = d.setdefault("metadata", {})
        if k.get("namespace"):
            meta["namespace"] = k["namespace"]
        for lab in k.get("labels", []):
            meta.setdefault("labels", {}).update(lab.get("pairs", {}))
        apply_images(d, k.get("images", []))
    return docs


def validate_dir(kdir: Path) -> list[str]:
    """Everything under ``kdir``: the kustomization (rendered), and every other YAML document
    there that is a Kubernetes object (has apiVersion and kind)."""
    kdir = Path(kdir)
    errors: list[str] = []
    listed: set[str] = set()
    if (kdir / "kustomization.yaml").is_file():
        problems = kustomization_problems(kdir)
        errors += problems
        if not problems:
            k = yaml.safe_load((kdir / "kustomization.yaml").read_text())
            listed = set(k.get("resources", []))
            docs = render_kustomization(kdir)
            errors += [f"kustomize build: {e}" for d in docs for e in validate_manifest(d)]
            errors += [f"kustomize build: {e}" for e in shared_home_problems(docs)]
    for f in sorted([*kdir.glob("*.yaml"), *kdir.glob("*.yml")]):
        if f.name == "kustomization.yaml" or f.name in listed:
            continue
        try:
            docs = load_docs(f)
        except yaml.YAMLError as exc:
            errors.append(f"{f.name}: not valid YAML: {exc}")
            continue
        for d in docs:
            if isinstance(d, dict) and "apiVersion" in d and "kind" in d:
                errors += [f"{f.name}: {e}" for e in validate_manifest(d)]
    return errors


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m k8s.validate DIR_OR_FILE...", file=sys.stderr)
        return 2
    errors: list[str] = []
    for a in args:
        p = Path(a)
        if p.is_dir():
            errors += validate_dir(p)
        else:
            errors += [f"{p.name}: {e}" for d in load_docs(p) for e in validate_manifest(d)]
    for e in errors:
        print(e)
    print("OK" if not errors else f"{len(errors)} error(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
