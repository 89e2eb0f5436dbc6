"""Tests of the Kubernetes manifests in k8s/ (schemas pinned in tests/k8s/schemas/)."""
