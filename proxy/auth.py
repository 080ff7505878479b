"""Client keys and the upstream's own key (``--upstream-api-key-env``).

Design: ``docs/design/request-path.md``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from collections.abc import Mapping

from proxy.config_values import SettingsError
from proxy.upstream_spec import UpstreamSpec, key_problem

_HEX = re.compile(r"^[0-9a-f]{64}$")

CLIENT_KEY_HEADERS: frozenset[bytes] = frozenset({b"authorization", b"x-api-key", b"api-key"})
"""Request headers that carry a client's key: checked, then removed before the request
goes upstream in server-held key mode."""

# When a client sends more than one, the key checked is the first of these that holds
# one, whatever the order of the headers on the wire.
_PRECEDENCE = {b"authorization": 0, b"x-api-key": 1, b"api-key": 2}


def upstream_header(mode: str, key: str) -> tuple[bytes, bytes]:
    """The (name, value) that carries the server-held ``key`` upstream, per ``--upstream-auth``."""
    value = key.encode("ascii")
    if mode == "bearer":
        return b"authorization", b"Bearer " + value
    if mode == "x-api-key":  # Anthropic
        return b"x-api-key", value
    if mode == "api-key":  # Azure OpenAI
        return b"api-key", value
    raise ValueError(f"unknown upstream auth mode {mode!r}")


class KeyCheck:
    """Checks a client's key against the stored digests.

    The key that goes upstream is each upstream's own (:func:`key_header`), decided once
    when the upstreams are built: the request path appends it after removing every
    :data:`CLIENT_KEY_HEADERS` header from the client's request.
    """

    __slots__ = ("_digests",)

    def __init__(self, digests: list[bytes]) -> None:
        self._digests = digests

    def __len__(self) -> int:
        return len(self._digests)

    def use(self, other: KeyCheck) -> None:
        """Accept ``other``'s keys from now on (SIGHUP re-read the keys file). One
        assignment: a check in progress on the event loop sees the old list or the new."""
        self._digests = other._digests

    def accepts(self, presented: bytes | None) -> bool:
        if not presented:
            return False
        digest = hashlib.sha256(presented).digest()
        ok = False
        for stored in self._digests:  # no early exit: same work for every key
            ok |= hmac.compare_digest(digest, stored)
        return ok


def key_header(spec: UpstreamSpec, env: Mapping[str, str]) -> tuple[bytes, bytes] | None:
    """The header that carries upstream ``spec``'s own key, or None when it holds none
    (then the client's key headers pass through, unless client keys are checked)."""
    if not spec.api_key_env:
        return None
    return upstream_header(spec.auth, env.get(spec.api_key_env, "").strip())


def load_key_check(keys_file: str | None, *, upstream_key_env: str, env: Mapping[str, str],
                   given_as: tuple[str, str] | None = None) -> KeyCheck | None:
    """The client key check from ``keys_file`` (``--client-keys-file``), or None for None:
    the composition root passes the file only when some upstream holds a key.

    Raises :class:`SettingsError` for an unusable key or keys file: ``upstream_key_env``
    (``--upstream-api-key-env``, may be empty) names the key's variable in ``env``.
    ``given_as`` names the two settings (key variable, keys file) as the operator gave
    them, flag or environment variable, for the message; the flags by default. (A config
    file's upstream keys were checked when the file was read, :mod:`proxy.upstream_spec`.)
    """
    if keys_file is None:
        return None
    key_name, file_name = given_as or ("--upstream-api-key-env", "--client-keys-file")
    if upstream_key_env:
        problem = key_problem(upstream_key_env, env)
        if problem:
            raise SettingsError(f"invalid setting {key_name}: {problem}")
    digests: list[bytes] = []
    try:
        with open(keys_file, encoding="utf-8") as fh:
            lines = fh.readlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"invalid setting {file_name}: cannot read "
                            f"{keys_file!r} ({type(exc).__name__})") from None
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip().lower().removeprefix("sha256:")
        if not text:
            continue
        if not _HEX.match(text):
            raise SettingsError(
                f"invalid setting {file_name}: line {number} is not a SHA-256 hex digest")
        digests.append(bytes.fromhex(text))
    if not digests:
        raise SettingsError(f"invalid setting {file_name}: no keys in the file")
    return KeyCheck(digests)


def presented_key(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The client's key from ``Authorization: Bearer``, ``x-api-key`` or ``api-key``.

    A header without a usable key (``Authorization: Basic ...``, an empty value) does
    not count; when several hold one, ``Authorization`` wins, then ``x-api-key``.
    """
    best_rank, best = len(_PRECEDENCE), None
    for name, value in headers:
        rank = _PRECEDENCE.get(name)
        if rank is None or rank >= best_rank:
            continue
        if rank == 0:
            scheme, _, token = value.partition(b" ")
            key = token.strip() if scheme.lower() == b"bearer" else b""
        else:
            key = value.strip()
        if key:
            best_rank, best = rank, key
    return best


OBSERVER_CHALLENGE = (b"www-authenticate", b'Basic realm="llm-latency-proxy", charset="UTF-8"')
"""What a 401 for ``/metrics`` or ``/ui`` says: a browser then asks its user for a user
name (any) and password (a client key), and sends them with every request to the
page's origin, the page's own ``/ui/data`` requests included."""


def observer_key(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The key on a request for ``/metrics`` or ``/ui``: as :func:`presented_key` reads it,
    else the password of ``Authorization: Basic`` (the user name is not looked at)."""
    key = presented_key(headers)
    if key:
        return key
    for name, value in headers:
        if name != b"authorization":
            continue
        scheme, _, token = value.partition(b" ")
        if scheme.lower() != b"basic":
            return None
        try:
            decoded = base64.b64decode(token.strip(), validate=True)
        except (ValueError, binascii.Error):
            return None
        _, colon, password = decoded.partition(b":")
        return password if colon and password else None
    return None
