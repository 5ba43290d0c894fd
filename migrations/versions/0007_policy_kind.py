"""policy kind

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05 23:30:00

``policies.kind``: where a policy came from (``adopted``, ``seeded``, ``refit``, ``forced``,
``other``; :class:`controller.store.kinds.PolicyKind`), written with the policy so that the
loop and the CLI read a typed value rather than a prefix of the reason (which a status change
rewrites). The upgrade backfills the policies stored before it from their reason's prefix and
``seeded_exploration``, as ``controller.store.kinds.kind_of_reason`` derives it, on SQLite
and PostgreSQL alike.

On SQLite both directions are a batch copy of ``policies``, a parent table (env.py turns
foreign keys off).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | None = None
depends_on: str | None = None

# The prefixes as they were when this revision was written (a migration is frozen).
_BY_PREFIX = (("adopted: ", "adopted"), ("canary refit of v", "refit"),
              ("active calibration: forced ", "forced"))


def upgrade() -> None:
    with op.batch_alter_table("policies", schema=None) as batch_op:
        batch_op.add_column(sa.Column("kind", sa.String(length=16), server_default="other",
                                      nullable=False))
    policies = sa.table("policies", sa.column("reason", sa.Text()),
                        sa.column("seeded_exploration", sa.Float()),
                        sa.column("kind", sa.String(16)))
    # Compared as a substring, not with LIKE: "_" and "%" in a prefix are no wildcards.
    for prefix, kind in reversed(_BY_PREFIX):
        op.execute(policies.update()
                   .where(sa.func.substr(policies.c.reason, 1, len(prefix)) == prefix)
                   .values(kind=kind))
    op.execute(policies.update().where(policies.c.seeded_exploration.is_not(None))
               .values(kind="seeded"))


def downgrade() -> None:
    with op.batch_alter_table("policies", schema=None) as batch_op:
        batch_op.drop_column("kind")
