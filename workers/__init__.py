"""ctxsparse: workers."""
