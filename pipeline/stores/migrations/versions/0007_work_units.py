"""work units, unit keys, engine sessions and charges (tier workers); items.session_id; partitions.wave/generation

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "work_units",
        sa.Column("job_id", sa.String(200), primary_key=True),
        sa.Column("unit_id", sa.String(200), primary_key=True),
        sa.Column("partition", sa.String(64), nullable=False),
        sa.Column("tier", sa.String(100), nullable=False),
        sa.Column("wave", sa.Integer, nullable=False),
        sa.Column("requests", sa.Integer, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("worker", sa.String(200)),
        sa.Column("session_id", sa.String(200)),
        sa.Column("lost_session", sa.String(200)),
        sa.Column("epoch", sa.Integer, nullable=False, server_default="0"),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True)),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True)),
    )
    op.create_index("work_units_claim", "work_units", ["job_id", "tier", "status"])
    op.create_table(
        "unit_keys",
        sa.Column("job_id", sa.String(200), primary_key=True),
        sa.Column("item_key", sa.String(64), primary_key=True),
        sa.Column("unit_id", sa.String(200), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reason", sa.String(32)),
        sa.Column("detail", sa.Text),
    )
    op.create_index("unit_keys_unit", "unit_keys", ["job_id", "unit_id"])
    op.create_table(
        "engine_sessions",
        sa.Column("session_id", sa.String(200), primary_key=True),
        sa.Column("job_id", sa.String(200), nullable=False),
        sa.Column("tier", sa.String(100), nullable=False),
        sa.Column("worker", sa.String(200), nullable=False),
        sa.Column("gpus", sa.Integer, nullable=False),
        sa.Column("started", sa.Integer, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("startup_seconds", sa.Float, nullable=False),
        sa.Column("busy_seconds", sa.Float, nullable=False),
        sa.Column("idle_seconds", sa.Float, nullable=False),
        sa.Column("recorded_seconds", sa.Float, nullable=False),
        sa.Column("opened_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("closed_at", sa.DateTime(timezone=True)),
    )
    op.create_index("engine_sessions_job", "engine_sessions", ["job_id"])
    op.create_table(
        "charges",
        sa.Column("job_id", sa.String(200), primary_key=True),
        sa.Column("charge_id", sa.String(300), primary_key=True),
        sa.Column("partition", sa.String(64), nullable=False),
        sa.Column("session_id", sa.String(200), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("id", sa.Text),
        sa.Column("tenant", sa.String(200)),
        sa.Column("tier", sa.String(100), nullable=False),
        sa.Column("gpu_seconds", sa.Float, nullable=False),
    )
    with op.batch_alter_table("items") as batch:
        batch.add_column(sa.Column("session_id", sa.String(200), nullable=True))
    with op.batch_alter_table("partitions") as batch:
        batch.add_column(sa.Column("wave", sa.Integer, nullable=False, server_default="0"))
        batch.add_column(sa.Column("generation", sa.String(16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("partitions") as batch:
        batch.drop_column("generation")
        batch.drop_column("wave")
    with op.batch_alter_table("items") as batch:
        batch.drop_column("session_id")
    for table in ("charges", "engine_sessions", "unit_keys", "work_units"):
        op.drop_table(table)
