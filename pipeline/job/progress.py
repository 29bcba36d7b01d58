"""Progress of a running job: a live bar on a terminal, periodic plain log lines elsewhere (Airflow, cron).

While the job plans (before any item exists) a line says the planning step and how many of its inputs are
done. Then a log line says items done, reused, quarantined, dollars so far, seconds elapsed, items per second and
the time left at that rate; the engines' utilisation per tier is in the job summary `tokenmill run` prints at the
end. An item counts as done when its generation is stored, not when its partition commits (a partition commits
after all of its waves: minutes of "0 done" on a small job looked stuck); how many are committed is said apart."""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("tokenmill.progress")


PLANNING_UNITS = {"keyed": "input files or packs", "clustered": "shards", "staged": "partitions"}


class Progress:
    """Counts items done (output or quarantine), reused and quarantined, and dollars spent so far."""

    def __init__(self, mode: str = "auto", log_every_seconds: float = 10.0):
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "log"
        self.mode, self.every = mode, log_every_seconds
        self.total = self.done = self.reused = self.quarantined = 0
        self.usd = 0.0
        self.stored: dict[str, int] = {}  # partition -> generations stored there since it last committed
        self._bar = self._task = None
        self._last_log = 0.0
        self._started = time.monotonic()

    def start(self, total: int) -> None:
        self.total = total
        self._started = time.monotonic()
        if self._bar is not None:  # planning's bar: the same bar goes on with the items
            self._bar.update(self._task, completed=0, total=total, status="")
        elif self.mode == "bar":
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as Bar

            self._bar = Bar(
                TextColumn("[bold]tokenmill"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(),
                transient=False,
            )
            self._bar.start()
            self._task = self._bar.add_task("job", total=total, status="")
        self._show(force=True)

    def planning(self, step: str, done: int, total: int) -> None:
        """Planning's progress, before any item exists: `done` of `total` inputs of `step` (keyed: files;
        clustered: shards; staged: partitions). A log line at most every `log_every_seconds`, and one at
        each step's end; a terminal's bar shows the step."""
        if self.mode == "bar":
            if self._bar is None:
                self.start(0)
            self._bar.update(self._task, completed=done, total=total or None, status=f"planning: {step}")
        elif self.mode == "log":
            t = time.monotonic()
            if done == total or t - self._last_log >= self.every:
                self._last_log = t
                log.info(
                    "planning: %s %d/%d %s; %.0f s elapsed",
                    step,
                    done,
                    total,
                    PLANNING_UNITS.get(step, ""),
                    t - self._started,
                )

    def advance(
        self,
        done: int = 0,
        reused: int = 0,
        quarantined: int = 0,
        usd: float = 0.0,
        partition: str | None = None,
        stored: dict[str, int] | None = None,
    ) -> None:
        """`done`/`quarantined`: records of `partition` committed (its stored generations are now in them);
        `stored`: generations stored per partition, counted done until their partition commits."""
        self.done += done + quarantined
        self.reused += reused
        self.quarantined += quarantined
        self.usd += usd
        if partition is not None:
            self.stored.pop(partition, None)
        for p, n in (stored or {}).items():
            self.stored[p] = self.stored.get(p, 0) + n
        self._show()

    @property
    def shown(self) -> int:
        """Items done: committed records, and generations stored in partitions not committed yet (a retry, an
        escalation or a chunk is a generation too, so this can run ahead until the commit: never past the total)."""
        return min(self.total, self.done + sum(self.stored.values())) if self.total else self.done

    def status(self) -> str:
        return f"{self.done} committed, {self.reused} reused, {self.quarantined} quarantined, ${self.usd:.6f}"

    def _show(self, force: bool = False) -> None:
        if self.mode == "bar" and self._bar is not None:
            self._bar.update(self._task, completed=self.shown, status=self.status())
        elif self.mode == "log" and (force or time.monotonic() - self._last_log >= self.every):
            self._last_log = time.monotonic()
            elapsed, shown = self._last_log - self._started, self.shown
            rate = shown / elapsed if elapsed > 0 else 0.0
            left = f", {(self.total - shown) / rate:.0f} s left" if rate > 0 and shown < self.total else ""
            log.info(
                "progress: %d/%d done, %s; %.0f s, %.1f items/s%s",
                shown,
                self.total,
                self.status(),
                elapsed,
                rate,
                left,
            )

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.stop()
        elif self.mode == "log" and self.total:  # (a progress that only planned, e.g. the estimate's, has no items)
            self._show(force=True)
