"""request_scores: the scored requests of a task's shards (an ``eval`` unit with ``shard`` in its config), from
which the task's accuracy rows are assembled once every shard is done.

A new table only: every existing row is kept as it is.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'request_scores',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('unit_id', sa.String(length=64), nullable=False),
        sa.Column('request', sa.Integer(), nullable=False),
        sa.Column('loglikelihood', sa.Double(), nullable=False),
        sa.Column('greedy', sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(['unit_id'], ['work_units.id'], name=op.f('fk_request_scores_unit_id_work_units'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_request_scores')),
        sa.UniqueConstraint('unit_id', 'request', name=op.f('uq_request_scores_unit_id')),
    )


def downgrade() -> None:
    op.drop_table('request_scores')
