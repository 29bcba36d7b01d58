"""runner_leases: which `tokenmill serve` runs the batches of an output root

Two servers on one output root each ran its batches, and a restarted server could not tell whether the
one before it still ran. One row per output root holds the one lease (stores/lease.py): its holder runs
the batches, any other server answers the API only and takes over when the lease is free.

Revision ID: 0018
Revises: 0016
"""

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "runner_leases",
        sa.Column("root", sa.String(64), primary_key=True),
        sa.Column("output_uri", sa.Text, nullable=False),
        sa.Column("holder", sa.String(200), nullable=True),
        sa.Column("epoch", sa.Integer, nullable=False),
        sa.Column("renewed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("runner_leases")
