"""ctxsparse: dashboard."""
