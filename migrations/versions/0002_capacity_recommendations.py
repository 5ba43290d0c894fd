"""capacity recommendations

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 08:25:32.342946

A new table only: no existing table is altered, so no batch copy of a parent table (and no
foreign-key cascade on SQLite) is involved in either direction.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "recommendations",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("first_window_id", sa.Integer(), nullable=True),
        sa.Column("last_window_id", sa.Integer(), nullable=True),
        sa.Column("window_ids", sa.Text(), nullable=False),
        sa.Column("prefill_workers", sa.Integer(), nullable=False),
        sa.Column("decode_workers", sa.Integer(), nullable=False),
        sa.Column("current_prefill", sa.Integer(), nullable=True),
        sa.Column("current_decode", sa.Integer(), nullable=True),
        sa.Column("prefill_binding", sa.String(length=64), nullable=False),
        sa.Column("decode_binding", sa.String(length=64), nullable=False),
        sa.Column("prefill_utilisation", sa.Float(), nullable=False),
        sa.Column("decode_utilisation", sa.Float(), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("applied_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_recommendations")),
    )
    with op.batch_alter_table("recommendations", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_recommendations_created_at"), ["created_at"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("recommendations", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_recommendations_created_at"))
    op.drop_table("recommendations")
