"""Tests of the Kubernetes manifests in k8s/ (the validator and its pinned schemas live in k8s/)."""
