"""superseded policy status

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 05:10:00

A canary replaced by its canary refit was recorded as ``rolled_back`` with a reason starting
"superseded by its canary refit"; it now has its own status, ``superseded``, so a rollback
count is a count of regressions. Existing rows with that reason are converted; the downgrade
converts them back (their reason still says why).

The CHECK constraint is dropped and recreated; on SQLite that is a batch copy of
``policies``, a parent table (env.py turns foreign keys off for it).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | None = None
depends_on: str | None = None

OLD = ("candidate", "approved", "rejected", "rolled_back", "advisory")
NEW = (*OLD, "superseded")
SUPERSEDED_REASON = "superseded by its canary refit%"


def _check(statuses: tuple[str, ...]) -> str:
    return f"status IN ({', '.join(repr(s) for s in statuses)})"


def _set_check(statuses: tuple[str, ...]) -> None:
    with op.batch_alter_table("policies", schema=None) as batch_op:
        batch_op.drop_constraint(op.f("ck_policies_status"), type_="check")
        batch_op.create_check_constraint(op.f("ck_policies_status"), _check(statuses))


def _convert(old: str, new: str) -> None:
    op.execute(
        sa.text("UPDATE policies SET status = :new WHERE status = :old AND reason LIKE :reason")
        .bindparams(new=new, old=old, reason=SUPERSEDED_REASON)
    )


def upgrade() -> None:
    _set_check(NEW)
    _convert("rolled_back", "superseded")


def downgrade() -> None:
    _convert("superseded", "rolled_back")
    _set_check(OLD)
