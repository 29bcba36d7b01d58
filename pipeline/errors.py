"""What a job reports when it cannot finish."""

from __future__ import annotations


class JobError(RuntimeError):
    """A job that could not finish; the message is the one-line reason. `budget`: stopped by a budget cap."""

    def __init__(self, message: str, budget: bool = False):
        super().__init__(message)
        self.budget = budget
