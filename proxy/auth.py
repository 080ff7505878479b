"""Optional server-held upstream key (``--upstream-api-key-env``).

Off by default: the client's ``Authorization`` passes through untouched and the
upstream decides. When on, the proxy sends its own key upstream, so clients must
present one of the proxy's own keys instead. Those are stored as SHA-256 digests
(``--client-keys-file``: one hex digest a line, optionally ``sha256:`` in front;
``#`` comments), and a presented key is hashed and compared with every stored digest
in constant time, so neither the file nor the timing gives a key away.

Create a digest with ``printf %s "$KEY" | sha256sum``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re

from proxy.config import Settings, SettingsError

_HEX = re.compile(r"^[0-9a-f]{64}$")


class KeyCheck:
    __slots__ = ("_digests", "upstream_authorization")

    def __init__(self, upstream_key: str, digests: list[bytes]) -> None:
        self.upstream_authorization = b"Bearer " + upstream_key.encode()
        self._digests = digests

    def accepts(self, presented: bytes | None) -> bool:
        if not presented:
            return False
        digest = hashlib.sha256(presented).digest()
        ok = False
        for stored in self._digests:  # no early exit: same work for every key
            ok |= hmac.compare_digest(digest, stored)
        return ok


def load_key_check(settings: Settings) -> KeyCheck | None:
    if not settings.upstream_api_key_env:
        return None
    key = os.environ.get(settings.upstream_api_key_env, "")
    digests: list[bytes] = []
    with open(settings.client_keys_file, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            text = line.split("#", 1)[0].strip().lower().removeprefix("sha256:")
            if not text:
                continue
            if not _HEX.match(text):
                raise SettingsError(
                    f"invalid setting --client-keys-file: line {number} is not a SHA-256 hex digest")
            digests.append(bytes.fromhex(text))
    if not digests:
        raise SettingsError("invalid setting --client-keys-file: no keys in the file")
    return KeyCheck(key, digests)


def presented_key(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The client's key from ``Authorization: Bearer`` or Azure-style ``api-key``."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
        elif name == b"api-key" and value.strip():
            return value.strip()
    return None
