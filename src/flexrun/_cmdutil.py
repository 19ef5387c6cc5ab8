"""Small helpers shared by the subcommand modules (k8s, pipeline, observe).

Owns writing a command's text output and running a subcommand module on its own
(``python -m flexrun.k8s.commands``) with the same error rule as ``flexrun``: a
:class:`FlexrunError` becomes one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from flexrun.errors import ConfigError, FlexrunError


def write_output(text: str, output: str | None) -> None:
    """Write ``text`` to stdout (``output`` None or ``-``) or to the file ``output``.

    Raises:
        ConfigError: the file cannot be written.
    """
    if output in (None, "-"):
        sys.stdout.write(text)
        return
    assert output is not None
    try:
        Path(output).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"-o {output}: cannot write ({exc.strerror})") from exc


def standalone_main(
    add_parser: Callable[[argparse._SubParsersAction], None], argv: Sequence[str] | None
) -> int:
    """Parse ``argv`` with one module's subcommands and run the chosen one."""
    parser = argparse.ArgumentParser(prog="flexrun")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except FlexrunError as exc:
        print(f"flexrun: error: {exc}", file=sys.stderr)
        return 2
