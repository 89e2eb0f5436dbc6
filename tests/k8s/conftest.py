"""The manifests of k8s/, as files and as ``kubectl apply -k k8s/`` would render them."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from k8s.validate import load_docs, render_kustomization

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"


@pytest.fixture(scope="session")
def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


@pytest.fixture(scope="session")
def rendered() -> list[dict]:
    return render_kustomization(K8S)


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"].get("name") == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


@pytest.fixture(scope="session")
def raycluster(rendered) -> dict:
    return one(rendered, "RayCluster")


@pytest.fixture(scope="session")
def rayjob() -> dict:
    (doc,) = load_docs(K8S / "rayjob-sweep.yaml")
    return doc


@pytest.fixture(scope="session")
def example_secret() -> dict:
    (doc,) = load_docs(K8S / "secret.example.yaml")
    return doc
