"""items: the confidence signal (escalation) and map-reduce chunk counts

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

COLUMNS = [
    sa.Column("mean_logprob", sa.Float),  # mean log-probability of the output tokens
    sa.Column("chunks", sa.Integer),  # map-reduce: chunk summaries this output was reduced from
]


def upgrade() -> None:
    with op.batch_alter_table("items") as batch:
        for column in COLUMNS:
            batch.add_column(column)


def downgrade() -> None:
    with op.batch_alter_table("items") as batch:
        for column in COLUMNS:
            batch.drop_column(column.name)
