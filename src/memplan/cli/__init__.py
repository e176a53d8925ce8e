"""The command line, thin over memplan.api, and its reports."""

from memplan.cli.commands import cli, main  # noqa: F401  (the `memplan` entry point)
