"""Old names kept for one release after a rename: each use works and prints one line.

Delete this module, and the ``old=`` of the options that use it, in the next release.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


def warn_renamed(old: str, new: str) -> None:
    """One line on standard error: ``old`` still works in this release; ``new`` is its name."""
    print(
        f"llm-latency-proxy: warning: {old} is deprecated and goes in the next release: use {new}",
        file=sys.stderr,
    )


class RenamedFlag(argparse.Action):
    """A flag's old name, hidden from ``--help``: stores (or extends, with ``nargs``) into
    the new flag's ``dest`` and warns. ``new``: the flag's name now."""

    def __init__(
        self, option_strings: Sequence[str], dest: str, *, new: str, **kwargs: Any
    ) -> None:
        self.new = new
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if isinstance(self, argparse.BooleanOptionalAction):
            negated = bool(option_string and option_string.startswith("--no-"))
            warn_renamed(
                option_string or self.dest, "--no-" + self.new[2:] if negated else self.new
            )
            argparse.BooleanOptionalAction.__call__(self, parser, namespace, values, option_string)
            return
        warn_renamed(option_string or self.dest, self.new)
        if self.nargs in ("+", "*"):
            values = [*(getattr(namespace, self.dest, None) or []), *values]
        setattr(namespace, self.dest, values)


class RenamedSwitch(RenamedFlag, argparse.BooleanOptionalAction):
    """A ``--flag``/``--no-flag`` switch's old name, hidden from ``--help``, warning."""
