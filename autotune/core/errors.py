"""One exception tree, one place for exit codes.

User errors (bad input, impossible arithmetic) print one line and exit 2;
the CLI never shows a traceback for them.
"""

from __future__ import annotations


class AutotuneError(Exception):
    """Base of every error autotune raises on purpose."""

    exit_code = 1


class UserError(AutotuneError):
    """Something the user typed or pointed at is wrong; the message says how to fix it."""

    exit_code = 2


class ConfigError(UserError):
    """A ds_config is missing, malformed or impossible for a pipeline run."""


class InputFileError(UserError):
    """A metrics CSV, rule file or token file cannot be read or parsed."""


class StudyError(UserError):
    """The study folder is not an autotune study, or is from another version."""


class TrialError(AutotuneError):
    """A trial failed; carries a classified reason. Never escapes the tuning loop."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
