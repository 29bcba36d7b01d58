"""items: the digest of the LoRA adapter each item was made with

Item keys carried the adapter's digest, but nothing an analyst reads did: the ledger named the adapter's
folder, which stays the same when the adapter is retrained in place. Items made before this version
have none (null).

Revision ID: 0012
Revises: 0011
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("items") as batch:
        batch.add_column(sa.Column("adapter_digest", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("items") as batch:
        batch.drop_column("adapter_digest")
