#!/usr/bin/env bash
# Runs once, when the postgres image initialises an empty data directory (docker-entrypoint-initdb.d).
# Creates the dashboard's read-only login role ctxsparse_ro: SELECT on every table in schema public,
# now and (default privileges) on tables that $POSTGRES_USER creates later, i.e. by `python -m db upgrade`.
# A .sh rather than a .sql: the role's password comes from the Secret (CTXSPARSE_RO_PASSWORD).
# On an existing database, run the same SQL by hand (see k8s/README.md).
set -euo pipefail
: "${CTXSPARSE_RO_PASSWORD:?set CTXSPARSE_RO_PASSWORD (Secret ctxsparse-db)}"
psql -v ON_ERROR_STOP=1 --no-psqlrc --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
     -v owner="$POSTGRES_USER" -v dbname="$POSTGRES_DB" -v ro_password="$CTXSPARSE_RO_PASSWORD" <<'EOSQL'
CREATE ROLE ctxsparse_ro LOGIN PASSWORD :'ro_password';
ALTER ROLE ctxsparse_ro SET default_transaction_read_only = on;
GRANT CONNECT ON DATABASE :"dbname" TO ctxsparse_ro;
GRANT USAGE ON SCHEMA public TO ctxsparse_ro;
GRANT SELECT ON ALL TABLES IN SCHEMA public TO ctxsparse_ro;
ALTER DEFAULT PRIVILEGES FOR ROLE :"owner" IN SCHEMA public GRANT SELECT ON TABLES TO ctxsparse_ro;
EOSQL
