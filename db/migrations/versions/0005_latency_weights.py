"""latency_results.weights: what a latency row's decode read -- "gguf:" and the block formats of the GGUF's
projections (the quantized CPU runtime), "gguf:llama.cpp" (llama.cpp on the file), or the float dtype ("fp32",
"fp16", "bf16").

Rows written before this revision decoded float weights (the quantized runtime took no latency units): they
are back-filled from their unit's device type, "fp32" on the CPU; accelerator rows stay NULL (fp16 or bf16 as
the sweep chose, not recorded), and so do llama.cpp rows ("gguf:llama.cpp" for those).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0005'
down_revision: str | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('latency_results') as batch_op:
        batch_op.add_column(sa.Column('weights', sa.String(length=64), nullable=True))
    rows = sa.table('latency_results', sa.column('device_type', sa.String()), sa.column('runtime', sa.String()),
                    sa.column('weights', sa.String()))
    conn = op.get_bind()
    conn.execute(rows.update().where(rows.c.runtime == 'llama.cpp').values(weights='gguf:llama.cpp'))
    conn.execute(rows.update().where(rows.c.device_type == 'cpu', rows.c.runtime.like('ctxsparse-%'))
                 .values(weights='fp32'))


def downgrade() -> None:
    with op.batch_alter_table('latency_results') as batch_op:
        batch_op.drop_column('weights')
