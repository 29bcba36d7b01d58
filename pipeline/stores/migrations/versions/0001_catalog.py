"""jobs, partitions and items

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("job_id", sa.String(200), primary_key=True),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("config_fingerprint", sa.String(64), nullable=False),
        sa.Column("input_uri", sa.Text, nullable=False),
        sa.Column("output_uri", sa.Text, nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("started_at", TS),
        sa.Column("finished_at", TS),
        sa.Column("counts", sa.Text),
        sa.Column("error", sa.Text),
    )
    op.create_table(
        "partitions",
        sa.Column("job_id", sa.String(200), primary_key=True),
        sa.Column("partition", sa.String(64), primary_key=True),
        sa.Column("file", sa.Text, nullable=False),
        sa.Column("records", sa.Integer, nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("last_error", sa.Text),
        sa.Column("worker", sa.String(200)),
        sa.Column("heartbeat_at", TS),
        sa.Column("lease_expires_at", TS),
        sa.Column("started_at", TS),
        sa.Column("finished_at", TS),
        sa.Column("counts", sa.Text),
    )
    op.create_table(
        "items",
        sa.Column("job_id", sa.String(200), primary_key=True),
        sa.Column("item_key", sa.String(64), primary_key=True),
        sa.Column("id", sa.Text, nullable=False),
        sa.Column("tenant", sa.String(200), nullable=False),
        sa.Column("partition", sa.String(64), nullable=False),
        sa.Column("tier", sa.String(100), nullable=False),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("summary", sa.Text, nullable=False),
        sa.Column("prompt_tokens", sa.Integer, nullable=False),
        sa.Column("cached_prompt_tokens", sa.Integer, nullable=False),
        sa.Column("output_tokens", sa.Integer, nullable=False),
        sa.Column("finish_reason", sa.String(32), nullable=False),
        sa.Column("gpu_seconds", sa.Float, nullable=False),
        sa.Column("baseline_gpu_seconds", sa.Float, nullable=False),
        sa.Column("created_at", TS, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("items")
    op.drop_table("partitions")
    op.drop_table("jobs")
