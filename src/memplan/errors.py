"""Errors the user can fix: the CLI prints their message on one line and exits 2."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError


class UserError(Exception):
    """Bad input (unknown model or GPU, impossible numbers, unreadable file): exit code 2."""

    exit_code = 2


def validation_line(e: ValidationError, options: bool = False, renamed: dict[str, str] | None = None) -> str:
    """The first error of a pydantic ValidationError on one line, naming the field ('seq_len: ...') or,
    with `options`, the CLI option ('--seq-len: ...'; `renamed`: fields whose option has another name); a
    message that already names its options is kept.
    A wrong type says what was given."""
    err = e.errors()[0]
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"].endswith("_type"):  # int_type, float_type, ...: the value that was given
        msg += f", got {type(err['input']).__name__} {err['input']!r:.60}"
    if msg.startswith("--") or not err["loc"]:
        return msg
    where = ".".join(str(x) for x in err["loc"])
    if options:
        return f"--{(renamed or {}).get(where, where.replace('_', '-'))}: {msg}"
    return f"{where}: {msg}"
