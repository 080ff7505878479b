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


_GIVEN = "_renamed_given"  # on the namespace: dest -> (the flag that set it, its value)


def _once(parser: argparse.ArgumentParser, namespace: argparse.Namespace, dest: str,
          flag: str, value: Any) -> None:
    """Record that ``flag`` set ``dest`` to ``value``; an error when the setting's other
    name set it to something else on the same command line (else the last would win,
    silently)."""
    given = namespace.__dict__.setdefault(_GIVEN, {})
    before = given.get(dest)
    if before is not None and before[0] != flag and before[1] != value:
        parser.error(f"{before[0]} {before[1]} and {flag} {value} are one setting given "
                     "twice: give it once, by its new name")
    given[dest] = (flag, value)


class NewName(argparse._StoreAction):
    """The new name of a renamed flag: stores, as a plain flag does, unless the old name
    gave the same setting another value (:class:`RenamedFlag`)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        _once(parser, namespace, self.dest, option_string or self.dest, values)
        super().__call__(parser, namespace, values, option_string)


class RenamedFlag(argparse.Action):
    """A flag's old name, hidden from ``--help``: stores (or extends, with ``nargs``) into
    the new flag's ``dest`` and warns; given with its new name (:class:`NewName`) and
    another value, an error. ``new``: the flag's name now."""

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
        if self.nargs in ("+", "*"):  # more of a list: both names add to it
            values = [*(getattr(namespace, self.dest, None) or []), *values]
        else:
            _once(parser, namespace, self.dest, option_string or self.dest, values)
        setattr(namespace, self.dest, values)


class RenamedSwitch(RenamedFlag, argparse.BooleanOptionalAction):
    """A ``--flag``/``--no-flag`` switch's old name, hidden from ``--help``, warning."""
