"""ctxsparse: packaging for hosts without a package index, and the host scripts (run from the project tree)."""
