"""policy promoted_at

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02 01:20:00

When a canary was promoted to every router: the cycle watches the fleet's goodput for a few
windows from then and rolls the promotion back when it falls well below the bake's. A
nullable column; existing policies have none (nothing older is watched). On SQLite the
downgrade is a batch copy of ``policies``, a parent table (env.py turns foreign keys off).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("policies", schema=None) as batch_op:
        batch_op.add_column(sa.Column("promoted_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("policies", schema=None) as batch_op:
        batch_op.drop_column("promoted_at")
