"""ctxsparse SQL store: typed models, engine/session helpers, typed queries, Alembic migrations, and the one
interface the layers above use (``db.store.Store``; sessions and queries stay inside ``db``).

    from db import get_engine, upgrade, session_scope, queries
"""

from db.engine import (
    ReadOnlyDatabaseError,
    current_revision,
    default_url,
    get_engine,
    head_revision,
    session_scope,
    upgrade,
)

__all__ = [
    "ReadOnlyDatabaseError",
    "current_revision",
    "default_url",
    "get_engine",
    "head_revision",
    "session_scope",
    "upgrade",
]
