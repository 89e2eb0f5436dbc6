"""latency_results.cpu_flags, isa: the CPU's feature flags of interest and the instruction set the native CPU
kernels were built for (avx512 / avx2 / neon / scalar, "fallback" where they did not build); the ISA joins the
row's natural key.

One unit timed under two builds keeps a row of each: the unique constraint over (unit, device type, accelerator,
batch, prompt length, runtime) becomes two partial unique indexes, that key where ``isa`` is NULL and that key
plus ``isa`` where it is not (NULLs never compare equal, so a plain constraint with ``isa`` would let a GPU row,
whose ``isa`` is NULL, be recorded twice).

Rows written before this revision did not record the build: both columns stay NULL. Downgrading refuses while
one key holds rows of several builds (the old constraint cannot hold them); delete the extra rows first.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0006'
down_revision: str | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

KEY = ['unit_id', 'device_type', 'accelerator_name', 'batch', 'prompt_len', 'runtime']


def upgrade() -> None:
    with op.batch_alter_table('latency_results') as batch_op:
        batch_op.add_column(sa.Column('cpu_flags', sa.String(length=255), nullable=True))
        batch_op.add_column(sa.Column('isa', sa.String(length=16), nullable=True))
        batch_op.drop_constraint('uq_latency_results_unit_id', type_='unique')
    op.create_index('uq_latency_results_unit_id', 'latency_results', KEY, unique=True,
                    sqlite_where=sa.text('isa IS NULL'), postgresql_where=sa.text('isa IS NULL'))
    op.create_index('uq_latency_results_unit_id_isa', 'latency_results', [*KEY, 'isa'], unique=True,
                    sqlite_where=sa.text('isa IS NOT NULL'), postgresql_where=sa.text('isa IS NOT NULL'))


def downgrade() -> None:
    rows = sa.table('latency_results', *(sa.column(c) for c in KEY))
    cols = [rows.c[c] for c in KEY]
    dup = op.get_bind().execute(sa.select(*cols).group_by(*cols).having(sa.func.count() > 1).limit(1)).first()
    if dup is not None:
        raise RuntimeError(f"cannot downgrade below 0006: latency_results holds rows of several instruction-set "
                           f"builds for one key {dict(zip(KEY, dup))}; delete all but one build's rows first")
    op.drop_index('uq_latency_results_unit_id_isa', table_name='latency_results')
    op.drop_index('uq_latency_results_unit_id', table_name='latency_results')
    with op.batch_alter_table('latency_results') as batch_op:
        batch_op.drop_column('isa')
        batch_op.drop_column('cpu_flags')
        batch_op.create_unique_constraint('uq_latency_results_unit_id', KEY)
