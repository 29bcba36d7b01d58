#!/bin/sh
# The image's entrypoint, with the official Airflow image's convention (its /entrypoint), so that the
# official Helm chart's commands and args and the compose file's commands both run as written:
#   bash ... / sh ... / python ... / an absolute path   run as they are (the chart: `bash -c "exec airflow scheduler"`)
#   airflow <subcommand> ...                            runs `airflow <subcommand> ...`
#   <subcommand> ...                                    runs `airflow <subcommand> ...` (compose: `scheduler`)
#   nothing                                             runs `airflow --help`
# tests/unit/test_infra_commands.py runs this script for every component's command line.
set -e
case "${1:-}" in
    "") exec airflow --help ;;
    airflow) shift; exec airflow "$@" ;;
    bash | sh | python | python3 | /*) exec "$@" ;;
    *) exec airflow "$@" ;;
esac
