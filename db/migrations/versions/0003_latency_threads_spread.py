"""latency_results.threads, speedup_min, speedup_max: the thread count a row was measured at, and the spread of a
paired row's speedup.

``threads`` is back-filled from the ``threads`` of each row's unit config (every latency unit has carried it);
rows whose unit config lacks it stay NULL. The speedup spread was not measured before this revision: NULL.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('latency_results') as batch_op:
        batch_op.add_column(sa.Column('threads', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('speedup_min', sa.Double(), nullable=True))
        batch_op.add_column(sa.Column('speedup_max', sa.Double(), nullable=True))
    conn = op.get_bind()
    units = sa.table('work_units', sa.column('id', sa.String()), sa.column('config', sa.JSON()))
    rows = sa.table('latency_results', sa.column('unit_id', sa.String()), sa.column('threads', sa.Integer()))
    have = sa.select(rows.c.unit_id).distinct()
    for unit_id, config in conn.execute(sa.select(units.c.id, units.c.config).where(units.c.id.in_(have))):
        threads = (config or {}).get('threads')
        if isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1:
            conn.execute(rows.update().where(rows.c.unit_id == unit_id).values(threads=threads))


def downgrade() -> None:
    with op.batch_alter_table('latency_results') as batch_op:
        batch_op.drop_column('speedup_max')
        batch_op.drop_column('speedup_min')
        batch_op.drop_column('threads')
