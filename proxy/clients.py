"""Who is waiting: the raw value of the optional ``client`` label.

Design: ``docs/design/relay-and-export.md``.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Mapping, Sequence

from proxy.auth import presented_key
from proxy.config import FINGERPRINT_SECRET_ENV

UNKNOWN_CLIENT = "unknown"
OTHER_CLIENT = "other"
_MAX_LEN = 64

Identify = Callable[[Sequence[tuple[bytes, bytes]]], str]


def fingerprint(secret: bytes, key: bytes) -> str:
    """The label for ``key``: a keyed hash, never the key nor a plain hash of it."""
    return "key-" + hmac.new(secret, key, hashlib.sha256).hexdigest()[:12]


def identify_from(source: str, env: Mapping[str, str]) -> Identify | None:
    """The function that names a request's client from ``--client-label-from``'s
    ``source``, or None when the label is off."""
    if not source:
        return None
    if source == "key":
        secret = env.get(FINGERPRINT_SECRET_ENV, "").strip().encode()
        if not secret:  # from_sources refuses this at start-up; here for direct callers
            raise ValueError(f"--client-label-from key needs {FINGERPRINT_SECRET_ENV}")

        def by_key(headers: Sequence[tuple[bytes, bytes]]) -> str:
            key = presented_key(list(headers))
            return fingerprint(secret, key) if key else UNKNOWN_CLIENT

        return by_key
    wanted = source.removeprefix("header:").encode()

    def by_header(headers: Sequence[tuple[bytes, bytes]]) -> str:
        for name, value in headers:
            if name == wanted:
                text = value.strip()
                if not text:
                    return UNKNOWN_CLIENT
                if len(text) > _MAX_LEN or not text.isascii() or not text.decode().isprintable():
                    return OTHER_CLIENT
                return text.decode()
        return UNKNOWN_CLIENT

    return by_header
