"""The one lease (stores/lease.py): planning and engine sessions get an expiry column like partitions and
work units, on the database's clock. Rows carried over expire at their last renewal: a planning or an
engine session alive across the upgrade is renewed by its worker's next beat, and a dead one is free.

Revision ID: 0016
Revises: 0015
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("planning_lease_expires_at", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("engine_sessions") as batch:
        batch.add_column(sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True))
    op.execute("UPDATE jobs SET planning_lease_expires_at = planning_renewed_at")
    op.execute("UPDATE engine_sessions SET lease_expires_at = heartbeat_at WHERE status = 'running'")


def downgrade() -> None:
    with op.batch_alter_table("engine_sessions") as batch:
        batch.drop_column("lease_expires_at")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("planning_lease_expires_at")
