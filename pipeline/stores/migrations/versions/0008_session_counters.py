"""engine_sessions: speculative-decoding and prefix-cache token counts per session (lever telemetry)

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

COLUMNS = ("spec_drafted", "spec_accepted", "prefix_queries", "prefix_hits")


def upgrade() -> None:
    with op.batch_alter_table("engine_sessions") as batch:
        for name in COLUMNS:
            batch.add_column(sa.Column(name, sa.BigInteger, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("engine_sessions") as batch:
        for name in reversed(COLUMNS):
            batch.drop_column(name)
