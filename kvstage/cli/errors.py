"""How the command line says that something went wrong: one literal message.

Every command reports a bad flag, a bad scenario or a failed run through `fail` (or
`warn`), never through its own print:
- the message is text, never rich markup: "allowed keys in [decode]" keeps its brackets;
- on a terminal it wraps to the width and the label is coloured;
- off a terminal (CI logs, pipes, `2>file`) it is one line, unwrapped, so that `grep
  error:` finds all of it: a message of several lines ("3 problems:" and one line per
  problem) is joined with "; ".
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.text import Text

err = Console(stderr=True, highlight=False)


def one_line(message: str) -> str:
    """The lines of `message` joined: after a line ending in ':' with a space, else '; '."""
    parts = [line.strip() for line in message.splitlines() if line.strip()]
    out = parts[0] if parts else ""
    for part in parts[1:]:
        out += (" " if out.endswith(":") else "; ") + part
    return out


def say(label: str, style: str, message: str, console: Console | None = None) -> None:
    """`label: message`, the label styled, the message literal."""
    c = console or err
    if not c.is_terminal:
        message = one_line(message)
    c.print(Text.assemble((f"{label}:", style), " ", message), soft_wrap=not c.is_terminal)


def fail(message: str, code: int = 2) -> NoReturn:
    """Print `error: message` and exit with `code` (2: bad input, 1: the run failed)."""
    say("error", "bold red", message)
    raise typer.Exit(code)


def warn(message: str) -> None:
    say("warning", "bold yellow", message)


def click_exceptions() -> ModuleType:
    """The exceptions of the click that typer runs: its own copy in typer >= 0.2x."""
    try:
        from typer._click import exceptions
    except ImportError:  # an older typer on the click package
        from click import exceptions
    return exceptions


def usage_error(exc: Any) -> int:
    """A flag click refused (unknown option, a value outside its choices): on a
    terminal typer's panel, off one the same one line as every other error."""
    if err.is_terminal:
        from typer import rich_utils

        rich_utils.rich_format_error(exc)
    else:
        ctx = getattr(exc, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        # typer checks Literal choices through pydantic, which prefixes "Value error, "
        say("error", "bold red", exc.format_message().replace("Value error, ", "") + hint)
    return exc.exit_code
