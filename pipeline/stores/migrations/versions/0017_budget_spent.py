"""budget_spent: a running total of the GPU-seconds each job has paid per tenant and tier

Admission under a budget cap summed every item and failed attempt of the job while holding the job
row's lock, so each admission cost O(items) and serialised every worker of the job behind it. The
statements that store items and failed attempts now add to this total; admission reads it. Jobs
carried over get their totals from what they have stored, and reservations no live claim holds
(claims taken over, units withdrawn: never deleted before) are deleted.

Revision ID: 0017
Revises: 0016
"""

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "budget_spent",
        sa.Column("job_id", sa.String(200), primary_key=True),
        sa.Column("tenant", sa.String(200), primary_key=True),  # "" for GPU time of no tenant
        sa.Column("tier", sa.String(100), primary_key=True),
        sa.Column("gpu_seconds", sa.Float, nullable=False),
    )
    op.execute(
        "INSERT INTO budget_spent (job_id, tenant, tier, gpu_seconds) "
        "SELECT job_id, tenant, tier, sum(gpu_seconds) FROM ("
        " SELECT job_id, tenant, tier, gpu_seconds FROM items"
        " UNION ALL SELECT job_id, coalesce(tenant, ''), tier, gpu_seconds FROM charges WHERE kind = 'failed_attempt'"
        ") AS paid GROUP BY job_id, tenant, tier HAVING sum(gpu_seconds) > 0"
    )

    # Reservations of claims taken over or units withdrawn were never deleted: the claim or withdrawal that
    # ends them deletes them now; those left from before go here.
    op.execute(
        "DELETE FROM budget_reservations WHERE NOT EXISTS (SELECT 1 FROM work_units w"
        " WHERE w.job_id = budget_reservations.job_id AND w.unit_id = budget_reservations.unit_id"
        " AND w.epoch = budget_reservations.epoch AND w.status = 'leased')"
    )


def downgrade() -> None:
    op.drop_table("budget_spent")
