"""partitions: the token of the derivation whose files are the partition's current wave

Two workers deriving a partition's next wave at once (one saw a follow-up in the reuse cache, the other
did not) wrote the same file names and both enqueued their keys: the wave could end up as one worker's
requests with the other's state, waiting for a key no request generates. Each derivation now writes files
of its own, named by a token, and the catalog takes one token with the wave in a compare-and-set.

Revision ID: 0013
Revises: 0012
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("partitions") as batch:
        batch.add_column(sa.Column("wave_token", sa.String(32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("partitions") as batch:
        batch.drop_column("wave_token")
