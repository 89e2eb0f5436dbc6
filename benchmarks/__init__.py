"""The maintained measurement tools, each tied to the BENCHMARKS.md section it feeds (``Feeds:`` in its docstring),
over one harness (``benchmarks.harness``); one-off experiments are in ``benchmarks.experiments``."""
