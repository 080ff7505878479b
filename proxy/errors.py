"""The error a command reports as one line and an exit code (click's ``ClickException``):
a command raises it, and :func:`proxy.cli.main` alone prints it and exits."""

from __future__ import annotations


class CliError(Exception):
    """A problem the command's user has to fix; the message is the one line printed."""

    exit_code = 2
