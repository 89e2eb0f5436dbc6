"""workers/evals"""
