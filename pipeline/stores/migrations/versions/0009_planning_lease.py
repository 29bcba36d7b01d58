"""jobs: planning's own lease (who plans, its fencing epoch, its last renewal)

Until now a job's `created_at` was also its planning lease's clock, and the planner was not recorded: a
dead planner could not be taken over at once or named, and a late step of a replaced planner was not
fenced out.

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("planner", sa.String(200), nullable=True))
        batch.add_column(sa.Column("planning_epoch", sa.Integer, nullable=False, server_default="0"))
        batch.add_column(sa.Column("planning_renewed_at", sa.DateTime(timezone=True), nullable=True))
    op.execute("UPDATE jobs SET planning_renewed_at = created_at")


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        for name in ("planning_renewed_at", "planning_epoch", "planner"):
            batch.drop_column(name)
