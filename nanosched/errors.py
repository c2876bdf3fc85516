"""Errors that name the bad input and what is allowed.

Library code raises these; the CLI turns them into a one-line message and exit code 2.
"""

from __future__ import annotations


class NanoschedError(Exception):
    """Base class of every error nanosched raises on purpose."""


class ConfigError(NanoschedError, ValueError):
    """A user-given input (flag, file, field) is missing or invalid.

    The message names the input, the value found and what is allowed.
    """


class ProfileError(NanoschedError, ValueError):
    """A profile file is malformed or lacks a row the caller needs."""


class ScheduleError(NanoschedError, ValueError):
    """A schedule file is malformed, inconsistent, or made for another setup."""
