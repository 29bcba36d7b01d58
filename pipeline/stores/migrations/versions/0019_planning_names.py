"""jobs: one name for the planning phase in the catalog: statuses and the lease's holder column

The phase that runs the CPU stages over the input was called `plan` by its step and its DAG task,
`staging` by its statuses and `planner` by its lease column. It is planning everywhere now: statuses
`planning` | `planning_failed` | `planned`, and the holder column `planning_worker` beside
`planning_epoch`, `planning_renewed_at` and `planning_lease_expires_at`. "Staging" names the staging
area (`_staging/`) only.

Revision ID: 0019
Revises: 0018
"""

from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

RENAMED = [("staging", "planning"), ("staging_failed", "planning_failed"), ("staged", "planned")]


def upgrade() -> None:
    for old, new in RENAMED:
        op.execute(f"UPDATE jobs SET status = '{new}' WHERE status = '{old}'")
    with op.batch_alter_table("jobs") as batch:
        batch.alter_column("planner", new_column_name="planning_worker")


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.alter_column("planning_worker", new_column_name="planner")
    for old, new in RENAMED:
        op.execute(f"UPDATE jobs SET status = '{old}' WHERE status = '{new}'")
