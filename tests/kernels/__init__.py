"""Tests of the kernels package (imported as ``tests.kernels``, so it never shadows the top-level ``kernels``)."""
