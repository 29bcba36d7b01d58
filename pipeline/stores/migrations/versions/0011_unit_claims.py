"""unit_claims: every claim of a work unit, by which session; replaces work_units.lost_session

A unit remembered only the last session it was taken from, and a dead session's lost work was shared
over the units taken from it so far: a partition committing before the dead session's other units were
taken over paid for all of it, and the others paid again. A dead session's lost work belongs to the
units it claimed and did not finish, which `unit_claims` keeps for good.

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "unit_claims",
        sa.Column("job_id", sa.String(200), primary_key=True),
        sa.Column("unit_id", sa.String(200), primary_key=True),
        sa.Column("epoch", sa.Integer, primary_key=True),
        sa.Column("session_id", sa.String(200), nullable=False),
        sa.Column("partition", sa.String(64), nullable=False),
        sa.Column("requests", sa.Integer, nullable=False),
        sa.Column("finished", sa.Integer, nullable=False, server_default="0"),
    )
    # Jobs mid-run keep what the units remember: their current claim and the one they were taken from.
    op.execute(
        "INSERT INTO unit_claims (job_id, unit_id, epoch, session_id, partition, requests, finished) "
        "SELECT job_id, unit_id, epoch, session_id, partition, requests, "
        "CASE WHEN status = 'leased' THEN 0 ELSE 1 END FROM work_units WHERE session_id IS NOT NULL"
    )
    op.execute(
        "INSERT INTO unit_claims (job_id, unit_id, epoch, session_id, partition, requests) "
        "SELECT job_id, unit_id, epoch - 1, lost_session, partition, requests FROM work_units "
        "WHERE lost_session IS NOT NULL AND epoch > 1"
    )
    with op.batch_alter_table("work_units") as batch:
        batch.drop_column("lost_session")


def downgrade() -> None:
    with op.batch_alter_table("work_units") as batch:
        batch.add_column(sa.Column("lost_session", sa.String(200), nullable=True))
    op.drop_table("unit_claims")
