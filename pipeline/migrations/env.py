"""Alembic environment: the URL comes from the caller (StateStore), never from a file."""

from alembic import context
from sqlalchemy import create_engine

from pipeline.state import Base

config = context.config
url = config.get_main_option("sqlalchemy.url")
engine = create_engine(url)
with engine.connect() as connection:
    # render_as_batch: SQLite cannot ALTER most things; batch mode rebuilds tables instead.
    context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()
engine.dispose()
