"""The reading side of the front: a model's settings from the store (``db.front.settings``), their Pareto front
and the choice of the setting to ship (``db.front.pareto``). The orchestrator, the CLI and the dashboard read
them through ``db.store.Store``; the pure functions of a front they import from here."""
