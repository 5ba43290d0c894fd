"""rejected candidates kept on their calibration

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06 01:30:00

``calibrations.candidate_body`` and ``calibrations.candidate_checksum``: the candidate policy
a calibration produced when the guardrail refused it, kept with the calibration that fitted
it instead of taking a policy version (a version number is taken only by a policy that can
run or be rolled out). Both NULL for every other calibration (its policy, if any, is
``policy_version``'s). Nothing is backfilled: rejected policies stored before this revision
keep their rows and their versions as they are, on SQLite and PostgreSQL alike.

On SQLite both directions are a batch copy of ``calibrations`` (a child table: nothing
points at it).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("calibrations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("candidate_body", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("candidate_checksum", sa.String(length=64),
                                      nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("calibrations", schema=None) as batch_op:
        batch_op.drop_column("candidate_checksum")
        batch_op.drop_column("candidate_body")
