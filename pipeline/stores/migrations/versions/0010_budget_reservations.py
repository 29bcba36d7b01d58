"""budget_reservations: what admitted engine calls are expected to cost, held against the job's caps

Until now each process admitted engine calls against what it had spent itself, so N tier workers (the
DAG's drain tasks, a retried task, a second `tokenmill run`) could each spend up to a cap. A reservation
row per admitted request makes the caps one amount that every worker of the job reserves from.

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "budget_reservations",
        sa.Column("job_id", sa.String(200), primary_key=True),
        sa.Column("unit_id", sa.String(200), primary_key=True),
        sa.Column("epoch", sa.Integer, primary_key=True),
        sa.Column("item_key", sa.String(64), primary_key=True),
        sa.Column("tenant", sa.String(200), nullable=False),
        sa.Column("usd", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("budget_reservations")
