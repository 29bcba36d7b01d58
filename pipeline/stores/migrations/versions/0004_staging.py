"""jobs: the staging phase is called staging (was planning): statuses renamed

Revision ID: 0004
Revises: 0003
"""

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

RENAMED = [("planning", "staging"), ("plan_failed", "staging_failed"), ("planned", "staged")]


def upgrade() -> None:
    for old, new in RENAMED:
        op.execute(f"UPDATE jobs SET status = '{new}' WHERE status = '{old}'")


def downgrade() -> None:
    for old, new in RENAMED:
        op.execute(f"UPDATE jobs SET status = '{old}' WHERE status = '{new}'")
