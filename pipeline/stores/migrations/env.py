"""Alembic environment: the URL comes from the caller (StateStore), never from a file."""

from alembic import context
from sqlalchemy import create_engine, text

from pipeline.stores.catalog import Base

config = context.config
url = config.get_main_option("sqlalchemy.url")
engine = create_engine(url)
with engine.connect() as connection:
    # render_as_batch: SQLite cannot ALTER most things; batch mode rebuilds tables instead.
    context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # Workers starting together: one migrates, the others wait here, then find the schema current.
            connection.execute(text("SELECT pg_advisory_xact_lock(71462210)"))
        context.run_migrations()
engine.dispose()
