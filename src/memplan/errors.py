"""Errors the user can fix: the CLI prints their message on one line and exits 2."""


class UserError(Exception):
    """Bad input (unknown model or GPU, impossible numbers, unreadable file): exit code 2."""

    exit_code = 2
