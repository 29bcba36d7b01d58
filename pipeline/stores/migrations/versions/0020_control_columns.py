"""jobs, partitions: control data in columns of its own, out of the `counts` JSON

What the steps decide by was kept in the rows' `counts` beside the figures a manifest adds up, and read by
parsing that JSON: a job's tenant isolation fingerprint and its batch files (`counts.staging.isolation`,
`counts.staging.batch_files`), a committed partition's commit record (`counts.commit`: the claim's id, epoch
and staged files) and its metrics figures (`counts.metrics`). Each is a column now (`jobs.isolation`,
`jobs.batch_files`, `partitions.commit_id`, `commit_epoch`, `commit_files`, `figures`), and the rows' values
move into them; `counts` keeps the figures only. The downgrade moves them back.

Revision ID: 0020
Revises: 0019
"""

import json

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

JOBS = sa.table(
    "jobs",
    sa.column("job_id", sa.String),
    sa.column("counts", sa.Text),
    sa.column("isolation", sa.String),
    sa.column("batch_files", sa.JSON),
)
PARTITIONS = sa.table(
    "partitions",
    sa.column("job_id", sa.String),
    sa.column("partition", sa.String),
    sa.column("counts", sa.Text),
    sa.column("commit_id", sa.String),
    sa.column("commit_epoch", sa.Integer),
    sa.column("commit_files", sa.JSON),
    sa.column("figures", sa.JSON),
)


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("isolation", sa.String(64), nullable=True))
        batch.add_column(sa.Column("batch_files", sa.JSON, nullable=True))
    with op.batch_alter_table("partitions") as batch:
        batch.add_column(sa.Column("commit_id", sa.String(64), nullable=True))
        batch.add_column(sa.Column("commit_epoch", sa.Integer, nullable=True))
        batch.add_column(sa.Column("commit_files", sa.JSON, nullable=True))
        batch.add_column(sa.Column("figures", sa.JSON, nullable=True))
    db = op.get_bind()
    for job_id, text in db.execute(sa.select(JOBS.c.job_id, JOBS.c.counts).where(JOBS.c.counts.is_not(None))).all():
        counts = json.loads(text)
        staging = counts.get("staging") or {}
        if "isolation" not in staging and "batch_files" not in staging:
            continue
        isolation, batch_files = staging.pop("isolation", None), staging.pop("batch_files", None)
        db.execute(
            sa.update(JOBS)
            .where(JOBS.c.job_id == job_id)
            .values(counts=json.dumps(counts), isolation=isolation, batch_files=batch_files or None)
        )
    rows = sa.select(PARTITIONS.c.job_id, PARTITIONS.c.partition, PARTITIONS.c.counts)
    for job_id, partition, text in db.execute(rows.where(PARTITIONS.c.counts.is_not(None))).all():
        counts = json.loads(text)
        if "commit" not in counts and "metrics" not in counts:
            continue
        commit, figures = counts.pop("commit", None) or {}, counts.pop("metrics", None)
        db.execute(
            sa.update(PARTITIONS)
            .where((PARTITIONS.c.job_id == job_id) & (PARTITIONS.c.partition == partition))
            .values(
                counts=json.dumps(counts),
                commit_id=commit.get("id"),
                commit_epoch=commit.get("epoch"),
                commit_files=commit.get("files"),
                figures=figures,
            )
        )


def downgrade() -> None:
    db = op.get_bind()
    for job_id, text, isolation, batch_files in db.execute(
        sa.select(JOBS.c.job_id, JOBS.c.counts, JOBS.c.isolation, JOBS.c.batch_files)
    ).all():
        if isolation is None and not batch_files:
            continue
        counts = json.loads(text) if text else {}
        staging = counts.setdefault("staging", {})
        staging |= {"isolation": isolation} if isolation is not None else {}
        staging |= {"batch_files": batch_files} if batch_files else {}
        db.execute(sa.update(JOBS).where(JOBS.c.job_id == job_id).values(counts=json.dumps(counts)))
    rows = db.execute(
        sa.select(
            PARTITIONS.c.job_id,
            PARTITIONS.c.partition,
            PARTITIONS.c.counts,
            PARTITIONS.c.commit_id,
            PARTITIONS.c.commit_epoch,
            PARTITIONS.c.commit_files,
            PARTITIONS.c.figures,
        )
    ).all()
    for job_id, partition, text, commit_id, epoch, files, figures in rows:
        if commit_id is None and figures is None:
            continue
        counts = json.loads(text) if text else {}
        if commit_id is not None:
            counts["commit"] = {"id": commit_id, "epoch": epoch, "files": files or {}}
        if figures is not None:
            counts["metrics"] = figures
        db.execute(
            sa.update(PARTITIONS)
            .where((PARTITIONS.c.job_id == job_id) & (PARTITIONS.c.partition == partition))
            .values(counts=json.dumps(counts))
        )
    with op.batch_alter_table("partitions") as batch:
        for column in ("figures", "commit_files", "commit_epoch", "commit_id"):
            batch.drop_column(column)
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("batch_files")
        batch.drop_column("isolation")
