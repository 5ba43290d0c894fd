"""policy promoted_at, calibration reference_for

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02 01:20:00

``policies.promoted_at``: when a canary was promoted to every router. The cycle watches the
fleet's goodput for a few windows from then and rolls the promotion back when it falls well
below the bake's. Existing policies have none (nothing older is watched).

``calibrations.reference_for`` (indexed): the policy whose drift reference a calibration
renewed, until now only in ``details``; a restart or a rollback looked for it by reading
every calibration since the policy was created. The upgrade copies it out of ``details``.

Both nullable. On SQLite the downgrade is a batch copy of ``policies``, a parent table
(env.py turns foreign keys off), and of ``calibrations``.
"""

from __future__ import annotations

import json

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("policies", schema=None) as batch_op:
        batch_op.add_column(sa.Column("promoted_at", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("calibrations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("reference_for", sa.BigInteger(), nullable=True))
        batch_op.create_index(batch_op.f("ix_calibrations_reference_for"), ["reference_for"],
                              unique=False)
    conn = op.get_bind()
    rows = conn.execute(sa.text(
        "SELECT id, details FROM calibrations WHERE details LIKE '%reference_for%'"
    )).all()
    for row_id, details in rows:
        renewed = json.loads(details).get("reference_for")
        if isinstance(renewed, int):
            conn.execute(sa.text("UPDATE calibrations SET reference_for = :v WHERE id = :id"),
                         {"v": renewed, "id": row_id})


def downgrade() -> None:
    with op.batch_alter_table("calibrations", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_calibrations_reference_for"))
        batch_op.drop_column("reference_for")
    with op.batch_alter_table("policies", schema=None) as batch_op:
        batch_op.drop_column("promoted_at")
