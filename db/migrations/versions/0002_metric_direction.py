"""accuracy_results.higher_is_better: each metric's direction stored with its row.

Existing rows are back-filled from the metric name (``ppl`` and ``nll``: lower is better; every other metric
the evaluator wrote so far: higher is better). The server default only serves that back-fill and is dropped
afterwards, so a writer must always say which way its metric points.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LOWER_IS_BETTER = ('ppl', 'nll')   # the only lower-is-better metrics written before this revision


def upgrade() -> None:
    with op.batch_alter_table('accuracy_results') as batch_op:
        batch_op.add_column(sa.Column('higher_is_better', sa.Boolean(), nullable=False,
                                      server_default=sa.true()))
    rows = sa.table('accuracy_results', sa.column('metric', sa.String()),
                    sa.column('higher_is_better', sa.Boolean()))
    op.execute(rows.update().where(rows.c.metric.in_(LOWER_IS_BETTER)).values(higher_is_better=False))
    with op.batch_alter_table('accuracy_results') as batch_op:
        batch_op.alter_column('higher_is_better', existing_type=sa.Boolean(), existing_nullable=False,
                              server_default=None)


def downgrade() -> None:
    with op.batch_alter_table('accuracy_results') as batch_op:
        batch_op.drop_column('higher_is_better')
