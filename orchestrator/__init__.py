"""ctxsparse: orchestrator."""
