"""Every Ray pod (head and all worker groups) mounts the same ReadWriteMany claim at the CTXSPARSE_HOME its env
declares: sweep actors exchange activations and predictor bundles through that folder (workers/units.py
``bundle_dir``, workers/sparsity/capture.py), and the driver on the head hands its CTXSPARSE_HOME to every actor."""
from __future__ import annotations

import copy
import shutil

import pytest
import yaml

from k8s import validate as v
from tests.k8s.conftest import K8S, one

HOME = "/var/lib/ctxsparse"
CLAIM = "ctxsparse-home"
GROUPS = ["head", "cpu", "nvidia-h200", "ascend-910b"]


def _groups(rc: dict) -> dict[str, dict]:
    return {"head": rc["spec"]["headGroupSpec"], **{g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}}


def _home_of(group: dict) -> tuple[str, str, dict]:
    """(CTXSPARSE_HOME from env, claim mounted there, the mount) of a group's Ray container."""
    pod = group["template"]["spec"]
    c = pod["containers"][0]
    home = {e["name"]: e for e in c["env"]}["CTXSPARSE_HOME"]["value"]
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == home]
    (vol,) = [x for x in pod["volumes"] if x["name"] == mount["name"]]
    return home, vol["persistentVolumeClaim"]["claimName"], mount


# ------------------------------------------------------------------ the manifests as shipped

def test_every_ray_pod_mounts_the_same_claim_at_its_ctxsparse_home(raycluster):
    groups = _groups(raycluster)
    assert sorted(groups) == sorted(GROUPS)
    homes = {name: _home_of(g) for name, g in groups.items()}
    assert {name: h[:2] for name, h in homes.items()} == {name: (HOME, CLAIM) for name in GROUPS}
    for name, (_, _, mount) in homes.items():
        assert not mount.get("readOnly") and "subPath" not in mount, name
    # no group keeps a per-pod emptyDir under the old volume name
    for name, g in groups.items():
        assert all("emptyDir" not in x for x in g["template"]["spec"]["volumes"] if x["name"] == CLAIM), name


def test_the_claim_is_read_write_many_and_in_the_kustomization(rendered, kustomization):
    assert "home-pvc.yaml" in kustomization["resources"]
    pvc = one(rendered, "PersistentVolumeClaim", CLAIM)
    assert pvc["metadata"]["namespace"] == one(rendered, "RayCluster")["metadata"]["namespace"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["storageClassName"]          # a placeholder users patch (k8s/README.md "Storage")
    assert pvc["spec"]["resources"]["requests"]["storage"]


def test_readme_says_how_to_set_the_storage_class():
    readme = (K8S / "README.md").read_text()
    pvc = yaml.safe_load((K8S / "home-pvc.yaml").read_text())
    assert "home-pvc.yaml" in readme and "ReadWriteMany" in readme
    assert pvc["spec"]["storageClassName"] in readme and "patches:" in readme


def test_shared_home_rule_holds(rendered):
    assert v.shared_home_problems(rendered) == []


# ------------------------------------------------------------------ broken manifests

def _break(rendered, how):
    docs = copy.deepcopy(rendered)
    how(one(docs, "RayCluster"), docs)
    return v.shared_home_problems(docs)


def _vol(group):
    return next(x for x in group["template"]["spec"]["volumes"] if x["name"] == CLAIM)


def _mount(group):
    return next(m for m in group["template"]["spec"]["containers"][0]["volumeMounts"] if m["name"] == CLAIM)


def _emptydir_in_nvidia(rc, docs):
    vol = _vol(_groups(rc)["nvidia-h200"])
    del vol["persistentVolumeClaim"]
    vol["emptyDir"] = {}


def _other_claim_in_cpu(rc, docs):
    _vol(_groups(rc)["cpu"])["persistentVolumeClaim"]["claimName"] = "ctxsparse-home-cpu"


def _mount_path_typo_in_ascend(rc, docs):
    _mount(_groups(rc)["ascend-910b"])["mountPath"] = "/var/lib/ctxspares"


def _no_home_env_on_head(rc, docs):
    c = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    c["env"] = [e for e in c["env"] if e["name"] != "CTXSPARSE_HOME"]


def _claim_missing(rc, docs):
    docs.remove(one(docs, "PersistentVolumeClaim", CLAIM))


def _claim_read_write_once(rc, docs):
    one(docs, "PersistentVolumeClaim", CLAIM)["spec"]["accessModes"] = ["ReadWriteOnce"]


def _read_only_with_subpath_on_cpu(rc, docs):
    _mount(_groups(rc)["cpu"]).update(readOnly=True, subPath="cpu")


BROKEN = {
    "emptyDir in one group": (_emptydir_in_nvidia, [
        "RayCluster/ctxsparse: spec.workerGroupSpecs[1].template.spec.volumes[0] (nvidia-h200): volume "
        "'ctxsparse-home' mounted at CTXSPARSE_HOME=/var/lib/ctxsparse is emptyDir, not a persistentVolumeClaim: "
        "every Ray pod must mount the same ReadWriteMany claim there"]),
    "another claim in one group": (_other_claim_in_cpu, [
        "RayCluster/ctxsparse: the Ray pods do not share one CTXSPARSE_HOME (head, nvidia-h200, ascend-910b: claim "
        "'ctxsparse-home' at /var/lib/ctxsparse; cpu: claim 'ctxsparse-home-cpu' at /var/lib/ctxsparse)",
        "RayCluster/ctxsparse: claim 'ctxsparse-home-cpu' (mounted at CTXSPARSE_HOME by cpu) is not defined: add its "
        "PersistentVolumeClaim to the kustomization"]),
    "mountPath typo": (_mount_path_typo_in_ascend, [
        "RayCluster/ctxsparse: spec.workerGroupSpecs[2].template.spec.containers[0].volumeMounts (ascend-910b): "
        "nothing is mounted at CTXSPARSE_HOME=/var/lib/ctxsparse: mount the shared ReadWriteMany claim there"]),
    "env missing on the head": (_no_home_env_on_head, [
        "RayCluster/ctxsparse: spec.headGroupSpec.template.spec.containers[0].env (head): CTXSPARSE_HOME is not "
        "set: every Ray pod needs the path of the shared cache"]),
    "claim not in the kustomization": (_claim_missing, [
        "RayCluster/ctxsparse: claim 'ctxsparse-home' (mounted at CTXSPARSE_HOME by head, cpu, nvidia-h200, "
        "ascend-910b) is not defined: add its PersistentVolumeClaim to the kustomization"]),
    "claim ReadWriteOnce": (_claim_read_write_once, [
        "PersistentVolumeClaim/ctxsparse-home: spec.accessModes: ['ReadWriteOnce'] lacks 'ReadWriteMany' "
        "(Ray pods on different nodes mount it at CTXSPARSE_HOME)"]),
    "readOnly and subPath": (_read_only_with_subpath_on_cpu, [
        "RayCluster/ctxsparse: spec.workerGroupSpecs[0].template.spec.containers[0].volumeMounts[0] (cpu): "
        "CTXSPARSE_HOME is mounted readOnly; actors write there",
        "RayCluster/ctxsparse: spec.workerGroupSpecs[0].template.spec.containers[0].volumeMounts[0] (cpu): "
        "CTXSPARSE_HOME is mounted with a subPath; every pod must see the whole shared volume"]),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_shared_home_is_reported(rendered, case):
    how, expected = BROKEN[case]
    assert _break(rendered, how) == expected


def _copy_k8s(tmp_path):
    dst = tmp_path / "k8s"
    shutil.copytree(K8S, dst)
    return dst


def test_cli_fails_on_a_copy_with_the_claim_missing_in_one_group(tmp_path, capsys):
    dst = _copy_k8s(tmp_path)
    text = (dst / "raycluster.yaml").read_text()
    # the cpu group (the first worker group's volumes) back to a per-pod emptyDir
    rc = yaml.safe_load(text)
    _vol(rc["spec"]["workerGroupSpecs"][0]).pop("persistentVolumeClaim")
    _vol(rc["spec"]["workerGroupSpecs"][0])["emptyDir"] = {}
    (dst / "raycluster.yaml").write_text(yaml.safe_dump(rc, sort_keys=False))
    assert v.main([str(dst)]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [
        "kustomize build: RayCluster/ctxsparse: spec.workerGroupSpecs[0].template.spec.volumes[0] (cpu): volume "
        "'ctxsparse-home' mounted at CTXSPARSE_HOME=/var/lib/ctxsparse is emptyDir, not a persistentVolumeClaim: "
        "every Ray pod must mount the same ReadWriteMany claim there",
        "1 error(s)"]


def test_cli_fails_on_a_copy_with_a_typo_in_the_claim(tmp_path, capsys):
    dst = _copy_k8s(tmp_path)
    pvc = dst / "home-pvc.yaml"
    text = pvc.read_text()
    assert text.count("accessModes:") == 1
    pvc.write_text(text.replace("accessModes:", "accesModes:"))
    assert v.main([str(dst)]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [
        "kustomize build: PersistentVolumeClaim/ctxsparse-home: spec: Additional properties are not allowed "
        "('accesModes' was unexpected)",
        "kustomize build: PersistentVolumeClaim/ctxsparse-home: spec.accessModes: [] lacks 'ReadWriteMany' "
        "(Ray pods on different nodes mount it at CTXSPARSE_HOME)",
        "2 error(s)"]
