"""The manifests agree with each other, with the code, and with how KubeRay and Ray read them."""
from __future__ import annotations

import json
import posixpath
import re
import shlex
import shutil
from urllib.parse import urlsplit

import pytest
import yaml

from tests.k8s.conftest import K8S, ROOT, one
from k8s.validate import _image_name, load_docs, render_kustomization

# The Ray custom resource our Ascend actors request. Nothing in workers/ or orchestrator/ requests
# it yet; once code does, test_npu_resource_name_matches_the_code checks it against this name.
NPU_RESOURCE = "NPU"
GPU_LIMIT = "nvidia.com/gpu"
ASCEND_LIMIT = "huawei.com/Ascend910B"
READONLY_ROLE = "ctxsparse_ro"
SPEC_MOUNT_DIR = "/etc/ctxsparse"

DRIVER = ROOT / "orchestrator" / "driver.py"
DASHBOARD_APP = ROOT / "dashboard" / "app.py"


# ------------------------------------------------------------------ helpers

def _groups(rc: dict) -> dict[str, dict]:
    """Ray node groups by name ("head" for the head group)."""
    return {"head": rc["spec"]["headGroupSpec"], **{g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}}


def _pod_specs(docs: list[dict]):
    """(owner label, pod spec) of every pod template in the objects."""
    for d in docs:
        label = f"{d['kind']}/{d['metadata'].get('name') or d['metadata'].get('generateName')}"
        if d["kind"] == "RayCluster":
            for name, g in _groups(d).items():
                yield f"{label}[{name}]", g["template"]["spec"]
        elif d["kind"] in ("Deployment", "StatefulSet", "Job"):
            yield label, d["spec"]["template"]["spec"]


def _containers(docs: list[dict]):
    for label, spec in _pod_specs(docs):
        for c in spec.get("initContainers", []) + spec["containers"]:
            yield f"{label}/{c['name']}", c


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _ray_resources(param: str) -> dict:
    """A rayStartParams ``resources`` value as `ray start --resources=...` gets it through the shell
    (KubeRay passes the value verbatim): outer quote pair dropped, backslash escapes removed."""
    assert param[0] == param[-1] and param[0] in "'\"", f"resources must be quoted: {param!r}"
    return json.loads(param[1:-1].replace("\\", ""))


def _sweep_spec_path(rayjob: dict) -> str:
    return shlex.split(rayjob["spec"]["entrypoint"])[-1]


# ------------------------------------------------------------------ the code

def test_rayjob_entrypoint_is_the_documented_driver(rayjob):
    argv = shlex.split(rayjob["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "orchestrator.driver"]
    assert argv[3:] == [f"{SPEC_MOUNT_DIR}/sweep.yaml"]
    assert ROOT.joinpath(*"orchestrator.driver".split(".")).with_suffix(".py") == DRIVER


def test_rayjob_entrypoint_module_exists():
    assert DRIVER.is_file()


def test_migration_job_runs_our_db_cli(rendered):
    c = one(rendered, "Job", "ctxsparse-db-migrate")["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["python", "-m", "db", "upgrade"]
    cli = ROOT / "db" / "__main__.py"
    assert cli.is_file()
    assert re.search(r"""["']upgrade["']""", cli.read_text()), "db CLI has no 'upgrade' command"
    assert _env(c)["CTXSPARSE_DB_URL"]["valueFrom"]["secretKeyRef"]["key"] == "CTXSPARSE_DB_URL"


def test_dashboard_runs_streamlit_on_8501(rendered):
    c = one(rendered, "Deployment", "ctxsparse-dashboard")["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["streamlit", "run", "dashboard/app.py", "--server.address", "0.0.0.0",
                            "--server.port", "8501"]
    assert c["workingDir"] == "/app"
    assert [p["containerPort"] for p in c["ports"]] == [8501]
    svc = one(rendered, "Service", "ctxsparse-dashboard")["spec"]
    assert svc.get("type", "ClusterIP") == "ClusterIP"
    assert [(p["port"], p["targetPort"]) for p in svc["ports"]] == [(8501, "http")]


def test_dashboard_app_exists():
    assert DASHBOARD_APP.is_file()


def test_npu_resource_name_matches_the_code(raycluster):
    declared = _ray_resources(_groups(raycluster)["ascend-910b"]["rayStartParams"]["resources"])
    assert declared == {NPU_RESOURCE: 1}
    # what the actors request for an NPU placement is what the Ascend group declares
    from workers.actors import actor_options

    assert set(actor_options("npu")["resources"]) == {NPU_RESOURCE}


def test_npu_is_the_resource_ray_binds_to_ascend_devices():
    npu = pytest.importorskip("ray._private.accelerators.npu")
    assert npu.NPUAcceleratorManager.get_resource_name() == NPU_RESOURCE
    assert npu.NPUAcceleratorManager.get_visible_accelerator_ids_env_var() == "ASCEND_RT_VISIBLE_DEVICES"


def test_ray_version_is_the_pinned_one(raycluster):
    pin = re.search(r"^ray==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M)
    assert pin, "constraints.txt pins no ray version"
    assert raycluster["spec"]["rayVersion"] == pin.group(1)


# ------------------------------------------------------------------ Ray cluster layout

def test_raycluster_obeys_kuberay_rules(raycluster):
    """KubeRay v1.7.0 ValidateRayClusterMetadata/Spec rules that touch our cluster."""
    name = raycluster["metadata"]["name"]
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 53
    workers = raycluster["spec"]["workerGroupSpecs"]
    assert len({g["groupName"] for g in workers}) == len(workers)
    for g in workers:
        assert 0 <= g["minReplicas"] <= g.get("replicas", g["minReplicas"]) <= g["maxReplicas"], g["groupName"]
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", g["groupName"])
    for group_name, g in _groups(raycluster).items():
        # labels go in the group's top-level field, never in rayStartParams; resources in one place only
        assert "labels" not in g["rayStartParams"], group_name
        assert not ("resources" in g["rayStartParams"] and g.get("resources")), group_name
        assert all(isinstance(v, str) for v in g["rayStartParams"].values()), group_name


def test_head_takes_no_work_and_serves_the_dashboard(raycluster):
    head = _groups(raycluster)["head"]
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    assert head["rayStartParams"]["num-cpus"] == "0"
    c = head["template"]["spec"]["containers"][0]
    assert not {GPU_LIMIT, ASCEND_LIMIT} & set(c["resources"].get("limits", {}))


def test_accelerator_resources(raycluster):
    groups = _groups(raycluster)
    assert set(groups) == {"head", "cpu", "nvidia-h200", "ascend-910b"}
    for name, g in groups.items():
        res = g["template"]["spec"]["containers"][0]["resources"]
        extended = {k for k in res.get("limits", {}) if "/" in k}
        want = {"nvidia-h200": {GPU_LIMIT}, "ascend-910b": {ASCEND_LIMIT}}.get(name, set())
        assert extended == want, name
        for k in extended:
            assert res["limits"][k] == 1 and res["requests"].get(k, 1) == 1, name


def test_gpu_group_accelerator_type_matches_its_node_selector(raycluster):
    g = _groups(raycluster)["nvidia-h200"]
    product = g["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"]
    assert product == "NVIDIA-H200"
    declared = _ray_resources(g["rayStartParams"]["resources"])
    # Ray names the type from the device name without the vendor: "NVIDIA H200" -> "H200"
    assert declared == {f"accelerator_type:{product.removeprefix('NVIDIA-').split('-')[0]}": 1}
    assert {"key": GPU_LIMIT, "operator": "Exists", "effect": "NoSchedule"} in g["template"]["spec"]["tolerations"]


def test_ascend_group_environment(raycluster):
    g = _groups(raycluster)["ascend-910b"]
    spec = g["template"]["spec"]
    c = spec["containers"][0]
    env = _env(c)
    assert {"key": ASCEND_LIMIT, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert env["ASCEND_TOOLKIT_HOME"]["value"].startswith("/usr/local/Ascend/ascend-toolkit/")
    for var in ("ASCEND_HOME_PATH", "ASCEND_AICPU_PATH", "ASCEND_OPP_PATH", "TOOLCHAIN_HOME"):
        assert env[var]["value"].startswith("$(ASCEND_TOOLKIT_HOME)"), var
    names = list(env)
    assert all(names.index("ASCEND_TOOLKIT_HOME") < names.index(v) for v in env
               if "$(ASCEND_TOOLKIT_HOME)" in env[v].get("value", "")), "$(VAR) must refer to an earlier env"
    ld = env["LD_LIBRARY_PATH"]["value"].split(":")
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert "/usr/local/Ascend/driver/lib64" in ld and "/usr/local/Ascend/driver" in mounts
    arch = {"arm64": "aarch64", "amd64": "x86_64"}[spec["nodeSelector"]["kubernetes.io/arch"]]
    assert all(p.endswith(f"/linux/{arch}") for p in ld if "/linux/" in p)
    # Ray sets this per actor from the NPU resource; a pod-level value would pin every actor.
    for label, c in _containers([raycluster]):
        assert "ASCEND_RT_VISIBLE_DEVICES" not in _env(c), label


def test_ray_autoscaler_sees_the_groups(raycluster):
    """Ray's own reading of the RayCluster (what the in-tree autoscaler plans with)."""
    cfg = pytest.importorskip("ray.autoscaler._private.kuberay.autoscaling_config")
    types = cfg._derive_autoscaling_config_from_ray_cr(raycluster)["available_node_types"]
    res = {name: t["resources"] for name, t in types.items()}
    assert res["headgroup"]["CPU"] == 0 and "GPU" not in res["headgroup"]
    assert res["nvidia-h200"]["GPU"] == 1 and res["nvidia-h200"]["accelerator_type:H200"] == 1
    assert res["ascend-910b"][NPU_RESOURCE] == 1 and "GPU" not in res["ascend-910b"]
    assert res["cpu"]["CPU"] == 8 and "GPU" not in res["cpu"]
    assert all(types[n]["min_workers"] == 0 for n in ("cpu", "nvidia-h200", "ascend-910b"))


# ------------------------------------------------------------------ RayJob

def test_rayjob_targets_the_cluster_and_obeys_kuberay_rules(rayjob, raycluster, kustomization):
    spec = rayjob["spec"]
    assert rayjob["metadata"]["namespace"] == kustomization["namespace"]
    assert spec["clusterSelector"] == {"ray.io/cluster": raycluster["metadata"]["name"]}
    assert "rayClusterSpec" not in spec
    # KubeRay v1.7.0 ValidateRayJobSpec with a clusterSelector: no SidecarMode, no backoffLimit, no
    # suspend; shutdownAfterJobFinishes false allows no ttlSecondsAfterFinished.
    assert spec["submissionMode"] in {"K8sJobMode", "HTTPMode", "InteractiveMode"}
    assert spec["shutdownAfterJobFinishes"] is False
    assert not {"backoffLimit", "suspend", "ttlSecondsAfterFinished", "deletionStrategy"} & set(spec)
    # No entrypoint resources: Ray then keeps the driver on the head, where the spec is mounted.
    assert not {"entrypointNumCpus", "entrypointNumGpus", "entrypointResources"} & set(spec)
    name = rayjob["metadata"]["generateName"]
    assert re.fullmatch(r"[a-z]([-a-z0-9]*)-", name) and len(name) + 5 <= 47


def test_sweep_spec_is_mounted_where_the_driver_reads_it(raycluster, rayjob, rendered):
    path = _sweep_spec_path(rayjob)
    head = _groups(raycluster)["head"]["template"]["spec"]
    (mount,) = [m for m in head["containers"][0]["volumeMounts"] if m["mountPath"] == posixpath.dirname(path)]
    assert "subPath" not in mount, "a subPath mount never sees ConfigMap edits"
    (vol,) = [v for v in head["volumes"] if v["name"] == mount["name"]]
    assert vol["configMap"]["name"] == "ctxsparse-sweep-spec"
    assert vol["configMap"]["items"] == [{"key": "sweep.yaml", "path": posixpath.basename(path)}]
    spec = yaml.safe_load(one(rendered, "ConfigMap", "ctxsparse-sweep-spec")["data"]["sweep.yaml"])
    from orchestrator.spec import parse_spec

    parse_spec(spec, "ConfigMap ctxsparse-sweep-spec")      # the driver would accept it


# ------------------------------------------------------------------ images

def test_images_all_come_from_the_kustomize_list(kustomization, rendered, rayjob):
    rules = {r["name"]: r for r in kustomization["images"]}
    raw = [d for f in kustomization["resources"] for d in load_docs(K8S / f)]
    for label, c in _containers(raw):
        name = _image_name(c["image"])
        assert name in rules, f"{label}: image {c['image']} is not in kustomization.yaml images"
        assert c["image"] == f"{name}:{rules[name]['newTag']}", f"{label}: tag differs from kustomization.yaml"
    images = {label: c["image"] for label, c in _containers(rendered)}
    assert set(images.values()) == {"ctxsparse:0.1.0", "ctxsparse-ascend:0.1.0", "postgres:15"}
    assert [lab for lab, img in images.items() if img.startswith("ctxsparse-ascend")] == [
        "RayCluster/ctxsparse[ascend-910b]/ray-worker"]
    assert list(_containers([rayjob])) == []  # the submitter pod uses the head's image
    for label, c in _containers(rendered):  # the image contract (k8s/README.md): the repository at /app
        if c["image"].startswith("ctxsparse"):
            assert c.get("workingDir") == "/app", label


def test_retagging_reaches_the_ray_cluster(kustomization, tmp_path):
    """kustomize rewrites images inside custom resources too; check our emulation does, via a copy."""
    shutil.copytree(K8S, tmp_path / "k8s")
    k = dict(kustomization)
    k["images"] = [{"name": "ctxsparse", "newName": "registry.example.com/ml/ctxsparse", "newTag": "0.2.0"},
                   *[r for r in kustomization["images"] if r["name"] != "ctxsparse"]]
    (tmp_path / "k8s" / "kustomization.yaml").write_text(yaml.safe_dump(k))
    rc = one(render_kustomization(tmp_path / "k8s"), "RayCluster")
    imgs = {g: s["template"]["spec"]["containers"][0]["image"] for g, s in _groups(rc).items()}
    assert imgs == {"head": "registry.example.com/ml/ctxsparse:0.2.0", "cpu": "registry.example.com/ml/ctxsparse:0.2.0",
                    "nvidia-h200": "registry.example.com/ml/ctxsparse:0.2.0", "ascend-910b": "ctxsparse-ascend:0.1.0"}


# ------------------------------------------------------------------ database wiring

def _secret_refs(docs):
    for label, c in _containers(docs):
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                yield label, e["name"], ref


def test_every_secret_and_configmap_reference_resolves(rendered, example_secret):
    keys = set(example_secret["stringData"])
    for label, _, ref in _secret_refs(rendered):
        assert ref["name"] == example_secret["metadata"]["name"], label
        assert ref["key"] in keys, f"{label}: Secret has no key {ref['key']}"
    cms = {d["metadata"]["name"]: d["data"] for d in rendered if d["kind"] == "ConfigMap"}
    claims = {f"StatefulSet/{d['metadata']['name']}": {t["metadata"]["name"] for t in d["spec"]["volumeClaimTemplates"]}
              for d in rendered if d["kind"] == "StatefulSet"}
    for label, spec in _pod_specs(rendered):
        for vol in spec.get("volumes", []):
            if "configMap" in vol:
                cm = vol["configMap"]
                assert cm["name"] in cms, f"{label}: no ConfigMap {cm['name']}"
                for item in cm.get("items", []):
                    assert item["key"] in cms[cm["name"]], f"{label}: ConfigMap {cm['name']} has no {item['key']}"
        names = {v["name"] for v in spec.get("volumes", [])} | claims.get(label, set())
        for c in spec.get("initContainers", []) + spec["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["name"] in names, f"{label}/{c['name']}: no volume {m['name']}"


def test_example_secret_urls_are_consistent(example_secret, rendered):
    s = example_secret["stringData"]
    svc = one(rendered, "Service", "ctxsparse-postgres")
    port = svc["spec"]["ports"][0]["port"]
    for key, user, password in (("CTXSPARSE_DB_URL", s["POSTGRES_USER"], s["POSTGRES_PASSWORD"]),
                                ("CTXSPARSE_DB_URL_RO", READONLY_ROLE, s["CTXSPARSE_RO_PASSWORD"])):
        u = urlsplit(s[key])
        assert u.scheme == "postgresql+psycopg", key  # the driver db.engine uses
        assert (u.username, u.password, u.hostname, u.port, u.path) == \
            (user, password, svc["metadata"]["name"], port, f"/{s['POSTGRES_DB']}"), key
    assert all("REPLACE-ME" in s[k] for k in ("POSTGRES_PASSWORD", "CTXSPARSE_RO_PASSWORD"))


def test_dashboard_alone_uses_the_read_only_role(rendered, raycluster):
    users = {}
    for label, var, ref in _secret_refs(rendered):
        if var == "CTXSPARSE_DB_URL":
            users[label] = ref["key"]
    assert users.pop("Deployment/ctxsparse-dashboard/dashboard") == "CTXSPARSE_DB_URL_RO"
    assert set(users.values()) == {"CTXSPARSE_DB_URL"}
    ray_containers = {label for label, _ in _containers([raycluster])}
    assert ray_containers <= set(users), "every Ray pod (driver and workers) gets the store URL"
    script = one(rendered, "ConfigMap", "ctxsparse-postgres-init")["data"]["10-ctxsparse-readonly-role.sh"]
    assert f"CREATE ROLE {READONLY_ROLE} LOGIN" in script
    assert f"GRANT SELECT ON TABLES TO {READONLY_ROLE}" in script  # default privileges: future tables


def test_postgres_statefulset(rendered):
    sts = one(rendered, "StatefulSet", "ctxsparse-postgres")
    spec = sts["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert c["image"] == "postgres:15"
    assert spec["containers"][0]["volumeMounts"][0] == {"name": "data", "mountPath": "/var/lib/postgresql/data"}
    assert [t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]] == ["data"]
    assert sts["spec"]["serviceName"] == "ctxsparse-postgres"
    (init,) = [v for v in spec["volumes"] if v["name"] == "init"]
    assert init["configMap"]["defaultMode"] == 0o755  # executed, not sourced, by the entrypoint
    assert {"name": "init", "mountPath": "/docker-entrypoint-initdb.d", "readOnly": True} in c["volumeMounts"]
    assert {"POSTGRES_USER", "POSTGRES_PASSWORD", "POSTGRES_DB", "CTXSPARSE_RO_PASSWORD"} <= set(_env(c))


def test_services_select_pods_and_named_ports(rendered):
    pods = [(d["spec"]["template"]["metadata"]["labels"], d["spec"]["template"]["spec"])
            for d in rendered if d["kind"] in ("Deployment", "StatefulSet")]
    for svc in (d for d in rendered if d["kind"] == "Service"):
        sel = svc["spec"]["selector"]
        matches = [spec for labels, spec in pods if sel.items() <= labels.items()]
        assert len(matches) == 1, f"Service {svc['metadata']['name']} selects {len(matches)} pod templates"
        ports = {p["name"] for c in matches[0]["containers"] for p in c.get("ports", [])}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports, f"{svc['metadata']['name']}: no container port {p['targetPort']}"
