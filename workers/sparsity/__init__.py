"""workers/sparsity"""
