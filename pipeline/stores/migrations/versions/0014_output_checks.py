"""items: the output checks' measures (compression_ratio: a loop; copied_share: the document given back)

Revision ID: 0014
Revises: 0013
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("items") as batch:
        batch.add_column(sa.Column("compression_ratio", sa.Float, nullable=True))
        batch.add_column(sa.Column("copied_share", sa.Float, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("items") as batch:
        batch.drop_column("copied_share")
        batch.drop_column("compression_ratio")
