"""policy reissue_of

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04 05:10:00

``policies.reissue_of``: the version whose table a re-issued policy carries (re-issued under a
higher number above a router that was ahead: a restored backup, a manual push). The rollout
is read from the desired versions, the canary being the newest one some routers desire; a
fleet table re-issued mid-bake took a number above the canary's and was read as the canary.
The order of the tables is now their origin's. The upgrade fills it from the reason the
re-issue was stored with (``v4 re-issued above a router that was ahead``).

Nullable; on SQLite the downgrade is a batch copy of ``policies``, a parent table (env.py
turns foreign keys off).
"""

from __future__ import annotations

import re

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | None = None
depends_on: str | None = None

_REISSUE_REASON = re.compile(r"^v(\d+) re-issued above a router that was ahead")


def upgrade() -> None:
    with op.batch_alter_table("policies", schema=None) as batch_op:
        batch_op.add_column(sa.Column("reissue_of", sa.BigInteger(), nullable=True))
    conn = op.get_bind()
    rows = conn.execute(sa.text(
        "SELECT id, reason FROM policies WHERE reason LIKE 'v%re-issued above%'")).all()
    for row_id, reason in rows:
        m = _REISSUE_REASON.match(reason)
        if m:
            conn.execute(sa.text("UPDATE policies SET reissue_of = :v WHERE id = :id"),
                         {"v": int(m.group(1)), "id": row_id})


def downgrade() -> None:
    with op.batch_alter_table("policies", schema=None) as batch_op:
        batch_op.drop_column("reissue_of")
