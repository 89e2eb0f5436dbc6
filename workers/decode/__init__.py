"""workers/decode"""
