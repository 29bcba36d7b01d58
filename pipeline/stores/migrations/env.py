"""Alembic environment: the URL comes from the caller (StateStore), never from a file.

Every pending migration runs in one transaction, on SQLite as on PostgreSQL, so a worker killed midway leaves
the schema as it found it and the next run migrates from there. Python's sqlite3 driver opens a transaction
only before INSERT, UPDATE or DELETE and runs CREATE and ALTER outside any (and Alembic, taking SQLite's DDL
for non-transactional, commits each migration on its own): a first migration killed after some tables left
them without a version row, and every later run failed on "table jobs already exists". Here the driver opens
no transaction of its own, SQLAlchemy's begin emits BEGIN (its documented recipe for transactional DDL on
pysqlite), and Alembic is told that the DDL is transactional."""

from alembic import context
from sqlalchemy import create_engine, event, text

from pipeline.stores.catalog import Base

config = context.config
url = config.get_main_option("sqlalchemy.url")
engine = create_engine(url)
if engine.dialect.name == "sqlite":

    @event.listens_for(engine, "connect")
    def _driver_opens_no_transaction(dbapi_connection, _record):
        dbapi_connection.isolation_level = None

    @event.listens_for(engine, "begin")
    def _begin_covers_ddl(connection):
        connection.exec_driver_sql("BEGIN")


with engine.connect() as connection:
    # render_as_batch: SQLite cannot ALTER most things; batch mode rebuilds tables instead.
    context.configure(
        connection=connection, target_metadata=Base.metadata, render_as_batch=True, transactional_ddl=True
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # Workers starting together: one migrates, the others wait here, then find the schema current.
            connection.execute(text("SELECT pg_advisory_xact_lock(71462210)"))
        context.run_migrations()
engine.dispose()
