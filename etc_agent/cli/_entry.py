"""How both CLIs end: user mistakes are one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer


class UserError(Exception):
    """A mistake in the command line or its inputs: one line on stderr, exit code 2."""


def check_output(path: Path, flag: str) -> None:
    """A file the command will write: its directory must exist (said before any work is done)."""
    if path.is_dir():
        raise UserError(f"{flag} {path}: a directory; give a file name")
    if not path.parent.is_dir():
        raise UserError(f"{flag} {path}: no directory {path.parent}")


def run_app(
    app: typer.Typer,
    argv: list[str] | None,
    prog: str,
    user_errors: tuple[type[BaseException], ...],
    prepare: Callable[[list[str]], tuple[list[str], dict[str, Any]]] | None = None,
) -> None:
    """``prepare(argv) -> (argv, click context settings)`` runs first (its ValueErrors are user errors too)."""
    try:
        settings: dict[str, Any] = {}
        if prepare is not None:
            argv, settings = prepare(list(sys.argv[1:] if argv is None else argv))
        result = app(args=argv, standalone_mode=False, prog_name=prog, **settings)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.stderr.write("aborted\n")
        sys.exit(130)
    except typer.TyperException as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":
            sys.exit(2)
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        sys.stderr.write(f"{prog}: error: {message}\n")
        sys.exit(2)
    except user_errors as exc:
        text = str(exc).strip()
        sys.stderr.write(f"{prog}: error: {text.splitlines()[0] if text else type(exc).__name__}\n")
        sys.exit(2)
    sys.exit(result if isinstance(result, int) else 0)
