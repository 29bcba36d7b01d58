#!/bin/sh
# The tokenmill state catalog lives beside Airflow's metadata DB, in its own database and role.
set -e
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" <<SQL
CREATE ROLE tokenmill LOGIN PASSWORD '${POSTGRES_PASSWORD}';
CREATE DATABASE tokenmill OWNER tokenmill;
SQL
