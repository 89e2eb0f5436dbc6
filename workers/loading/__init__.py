"""workers/loading"""
