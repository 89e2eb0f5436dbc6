"""Alembic environment for the ctxsparse store.

Used programmatically by ``db.engine.upgrade`` (which hands over a connection in
``config.attributes["connection"]``) and by the alembic CLI (``alembic -c db/alembic.ini``,
URL from ``-x url=...``, else ``sqlalchemy.url``, else ``db.engine.default_url()``).
"""

from __future__ import annotations

from alembic import context

from db.engine import get_engine
from db.models import Base

config = context.config
target_metadata = Base.metadata


def _configure(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # ALTER support on SQLite
        compare_type=True,
    )


def run_migrations_offline() -> None:
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    context.configure(url=url, target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    engine = get_engine(url or None)
    try:
        with engine.connect() as connection:
            _configure(connection)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
