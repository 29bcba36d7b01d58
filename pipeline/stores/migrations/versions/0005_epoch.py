"""partitions: the fencing epoch (every claim increments it; heartbeats and commits must present it)

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("partitions") as batch:
        batch.add_column(sa.Column("epoch", sa.Integer, nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("partitions") as batch:
        batch.drop_column("epoch")
