"""One-off experiments: scripts that answered a question once, run as ``python -m benchmarks.experiments.NAME``.

Each names the history section that records its answer (``Recorded:`` in its docstring); none feeds a current
figure of BENCHMARKS.md. The maintained tools, each tied to the BENCHMARKS.md section it feeds (``Feeds:``), are
the modules of ``benchmarks/`` itself.
"""
