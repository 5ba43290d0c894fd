"""policy seeded_exploration

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05 22:00:00

``policies.seeded_exploration``: the exploration share the controller turned on in every cell
of the routers' own policy when it adopted one that explores nowhere (``[controller]
adopted_exploration``), so that the learner measures the route the routers never take. The
policy's provenance as a typed value (``pdctl status`` shows it); NULL for every other
policy, and for every policy stored before this revision (none was seeded then).

Nullable; on SQLite the downgrade is a batch copy of ``policies``, a parent table (env.py
turns foreign keys off).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("policies", schema=None) as batch_op:
        batch_op.add_column(sa.Column("seeded_exploration", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("policies", schema=None) as batch_op:
        batch_op.drop_column("seeded_exploration")
