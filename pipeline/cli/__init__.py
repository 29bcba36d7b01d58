"""cli: the `tokenmill` command. Wiring only; every verb calls into the pipeline package.

common.py holds the typer app, its groups and the shared helpers; each module below registers the
commands of one concern on import:
  jobs.py     run, rerun, estimate (its old name plan refused, naming it), status, jobs list
  ledger.py   ledger summary, ledger sql, report
  router.py   router train, router eval, router example-labels
  setup.py    config show/docs, models tiny/embedder, samples
  cache.py    cache forget
  evals.py    eval (the hold-out set on every tier: quality next to cost)

May import everything in pipeline (the top layer); nothing imports it.
"""

from pipeline.cli import cache, evals, jobs, ledger, router, setup  # noqa: F401  (registers the commands)
from pipeline.cli.common import app
from pipeline.cli.jobs import summary_table

__all__ = ["app", "main", "summary_table"]


def main() -> None:
    app()


if __name__ == "__main__":
    main()
