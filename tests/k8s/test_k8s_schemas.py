"""Every manifest parses and validates against the pinned schemas; broken ones fail with the path."""
from __future__ import annotations

import copy
import hashlib
import re

import pytest
import yaml

from k8s import validate as v
from tests.k8s.conftest import K8S, one

# Applied by hand, never by `kubectl apply -k` (see the comments at the top of each file).
APPLIED_SEPARATELY = {"rayjob-sweep.yaml", "secret.example.yaml"}


def test_every_yaml_file_parses():
    files = sorted(K8S.rglob("*.yaml")) + sorted(K8S.rglob("*.yml"))
    assert len(files) >= 8
    for f in files:
        docs = v.load_docs(f)
        assert docs, f"{f.name}: no YAML document"
        assert all(isinstance(d, dict) for d in docs), f"{f.name}: a document is not a mapping"


def test_kustomization_lists_only_existing_files_and_emulated_keys():
    assert v.kustomization_problems(K8S) == []


def test_every_manifest_is_in_the_kustomization_or_applied_separately(kustomization):
    listed = set(kustomization["resources"])
    sources = {f.split("=", 1)[-1] for g in kustomization["configMapGenerator"] for f in g["files"]}
    for f in sorted(K8S.glob("*.yaml")):
        if f.name == "kustomization.yaml" or f.name in sources:
            continue
        assert (f.name in listed) != (f.name in APPLIED_SEPARATELY), \
            f"{f.name}: list it in kustomization.yaml resources or in APPLIED_SEPARATELY (exactly one)"
    assert not listed & APPLIED_SEPARATELY


def test_rendered_kustomization_has_the_expected_objects(rendered):
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in rendered)
    assert kinds == sorted([
        ("RayCluster", "ctxsparse"), ("PersistentVolumeClaim", "ctxsparse-home"),
        ("StatefulSet", "ctxsparse-postgres"), ("Service", "ctxsparse-postgres"),
        ("Job", "ctxsparse-db-migrate"),
        ("Deployment", "ctxsparse-dashboard"), ("Service", "ctxsparse-dashboard"),
        ("ConfigMap", "ctxsparse-sweep-spec"), ("ConfigMap", "ctxsparse-postgres-init"),
    ])
    assert {d["metadata"]["namespace"] for d in rendered} == {"ctxsparse"}


def test_rendered_objects_validate(rendered):
    errors = [e for d in rendered for e in v.validate_manifest(d)]
    assert errors == []


@pytest.mark.parametrize("name", sorted(APPLIED_SEPARATELY))
def test_separately_applied_manifests_validate(name):
    (doc,) = v.load_docs(K8S / name)
    assert v.validate_manifest(doc) == []


def test_cli_reports_ok(capsys):
    assert v.main([str(K8S)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "OK"


def test_pinned_schemas_match_their_readme_hashes():
    readme = (v.SCHEMA_DIR / "README.md").read_text()
    pinned = dict((name, digest) for digest, name in re.findall(r"^\s+([0-9a-f]{64})  (\S+\.json)$", readme, re.M))
    files = sorted(p.name for p in v.SCHEMA_DIR.glob("*.json"))
    assert sorted(pinned) == files
    for name in files:
        assert hashlib.sha256((v.SCHEMA_DIR / name).read_bytes()).hexdigest() == pinned[name], name
    assert f"kuberay-{v.KUBERAY_VERSION}-raycluster.json" in files
    assert f"kubernetes-{v.KUBERNETES_VERSION}-strict.json" in files


# ------------------------------------------------------------------ broken manifests

def _workers(doc):
    return doc["spec"]["workerGroupSpecs"]


def test_worker_group_without_group_name_fails_naming_the_path(raycluster):
    broken = copy.deepcopy(raycluster)
    del _workers(broken)[1]["groupName"]
    assert v.validate_manifest(broken) == [
        "RayCluster/ctxsparse: spec.workerGroupSpecs[1]: 'groupName' is a required property"]


def test_replicas_as_a_word_fails_naming_the_path(raycluster):
    broken = copy.deepcopy(raycluster)
    _workers(broken)[2]["replicas"] = "two"
    assert v.validate_manifest(broken) == [
        "RayCluster/ctxsparse: spec.workerGroupSpecs[2].replicas: 'two' is not of type 'integer'"]


def test_broken_file_fails_the_cli(tmp_path, raycluster, capsys):
    broken = copy.deepcopy(raycluster)
    del _workers(broken)[0]["groupName"]
    (tmp_path / "raycluster.yaml").write_text(yaml.safe_dump(broken))
    assert v.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "raycluster.yaml: RayCluster/ctxsparse: spec.workerGroupSpecs[0]: 'groupName' is a required property" in out
    assert out.strip().endswith("1 error(s)")


def test_unknown_field_in_a_custom_resource_is_rejected(raycluster):
    broken = copy.deepcopy(raycluster)
    broken["spec"]["headGroupSpec"]["rayStartParam"] = {"num-cpus": "0"}  # typo of rayStartParams
    broken["metadata"]["lables"] = {}
    assert v.validate_manifest(broken) == [
        "RayCluster/ctxsparse: metadata: Additional properties are not allowed ('lables' was unexpected)",
        "RayCluster/ctxsparse: spec.headGroupSpec: Additional properties are not allowed "
        "('rayStartParam' was unexpected)",
    ]


def test_non_string_ray_start_param_is_rejected(raycluster):
    broken = copy.deepcopy(raycluster)
    broken["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0  # must be the string "0"
    assert v.validate_manifest(broken) == [
        "RayCluster/ctxsparse: spec.headGroupSpec.rayStartParams.num-cpus: 0 is not of type 'string'"]


def test_core_kinds_are_strict(rendered):
    dep = copy.deepcopy(one(rendered, "Deployment"))
    c = dep["spec"]["template"]["spec"]["containers"][0]
    c["imagePullPolicyy"] = "Always"
    c["env"].append(dict(c["env"][0]))
    svc = copy.deepcopy(one(rendered, "Service", "ctxsparse-dashboard"))
    svc["spec"]["ports"][0]["port"] = "8501"
    assert v.validate_manifest(dep) == [
        "Deployment/ctxsparse-dashboard: spec.template.spec.containers[0]: Additional properties are not "
        "allowed ('imagePullPolicyy' was unexpected)",
        "Deployment/ctxsparse-dashboard: spec.template.spec.containers[0].env: duplicate entry with "
        "name='CTXSPARSE_DB_URL'",
    ]
    assert v.validate_manifest(svc) == [
        "Service/ctxsparse-dashboard: spec.ports[0].port: '8501' is not of type 'integer'"]


def test_unknown_kind_and_non_mapping():
    assert v.validate_manifest({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}})[0].startswith(
        "Pod/p: (root): no pinned schema for apiVersion 'v1' kind 'Pod'")
    assert v.validate_manifest(["not", "a", "mapping"]) == [
        "(document): expected a mapping (a Kubernetes object), got list"]
