"""Re-create the pinned schema files in this folder (run by hand when bumping a version).

    python k8s/schemas/pin_schemas.py \
        --kuberay-crds <kuberay checkout>/ray-operator/config/crd/bases \
        --kubernetes-defs <kubernetes-validate wheel>/kubernetes_validate/kubernetes-json-schema/v1.30.0-local-strict/_definitions.json

KubeRay: the ``v1`` ``openAPIV3Schema`` of the RayCluster and RayJob CRDs, unchanged.
Kubernetes: the ``$defs`` closure of the kinds in ``CORE_KINDS``, ``description`` strings
dropped (they are 3/4 of the bytes and no validation keyword); nothing else changed.
See README.md here for the versions and where they come from.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
CORE_KINDS = [
    "io.k8s.api.apps.v1.Deployment",
    "io.k8s.api.apps.v1.StatefulSet",
    "io.k8s.api.batch.v1.Job",
    "io.k8s.api.core.v1.Service",
    "io.k8s.api.core.v1.ConfigMap",
    "io.k8s.api.core.v1.Secret",
    "io.k8s.api.core.v1.PersistentVolumeClaim",  # the shared CTXSPARSE_HOME (already in the StatefulSet closure)
    "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta",  # for the metadata of the Ray CRs
]


def _drop_descriptions(node):
    if isinstance(node, dict):
        return {k: _drop_descriptions(v) for k, v in node.items()
                if not (k == "description" and isinstance(v, str))}
    if isinstance(node, list):
        return [_drop_descriptions(v) for v in node]
    return node


def _dump(obj, path: Path) -> None:
    path.write_text(json.dumps(obj, sort_keys=True, separators=(",", ":")) + "\n")
    print(f"{path.name}: {path.stat().st_size // 1024} KiB")


def pin_kuberay(crd_dir: Path, version: str) -> None:
    for plural, kind in (("rayclusters", "raycluster"), ("rayjobs", "rayjob")):
        crd = yaml.safe_load((crd_dir / f"ray.io_{plural}.yaml").read_text())
        (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
        _dump(v1["schema"]["openAPIV3Schema"], HERE / f"kuberay-{version}-{kind}.json")


def pin_kubernetes(defs_file: Path, version: str) -> None:
    doc = json.loads(defs_file.read_text())
    defs = doc["$defs"]
    keep, todo = set(), list(CORE_KINDS)
    while todo:
        name = todo.pop()
        if name not in keep:
            keep.add(name)
            todo += re.findall(r'"\$ref": "#/\$defs/([^"]+)"', json.dumps(defs[name]))
    out = {"$schema": doc["$schema"], "$id": doc["$id"],
           "$defs": _drop_descriptions({k: defs[k] for k in sorted(keep)})}
    _dump(out, HERE / f"kubernetes-{version}-strict.json")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kuberay-crds", type=Path)
    ap.add_argument("--kuberay-version", default="v1.7.0")
    ap.add_argument("--kubernetes-defs", type=Path)
    ap.add_argument("--kubernetes-version", default="v1.30.0")
    a = ap.parse_args()
    if a.kuberay_crds:
        pin_kuberay(a.kuberay_crds, a.kuberay_version)
    if a.kubernetes_defs:
        pin_kubernetes(a.kubernetes_defs, a.kubernetes_version)
