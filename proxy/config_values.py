"""What a setting's value may be, whichever source gives it: the error that names a bad
one (:class:`SettingsError`), and the checks that both :mod:`proxy.config` (flags,
``LLM_PROXY_*`` variables, a config file's top-level keys) and
:mod:`proxy.upstream_spec` (the file's ``[[upstream]]`` tables) apply: a URL, an
upstream's base URL, a header name.

It is the bottom of the settings and imports nothing of the proxy but its error base: the ``[[upstream]]``
tables are checked below :mod:`proxy.config`, which reads them into its settings.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from proxy.errors import CliError


class SettingsError(CliError, ValueError):
    """A setting has a bad value; the message names it and is one line."""


def parse_url(raw: str) -> str:
    parts = urlsplit(raw.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an http(s) URL with a host, e.g. https://api.openai.com/v1")
    if parts.query or parts.fragment:
        raise ValueError("must not carry a query string or fragment")
    _ = parts.port  # raises ValueError for a bad port ("host:99999", "host:abc")
    return raw.strip().rstrip("/")


def parse_upstream_url(raw: str) -> str:
    """An upstream's base URL (``--upstream``, an ``[[upstream]]`` table's ``url``):
    :func:`parse_url`, and no user info. The upstream client never sends URL credentials
    (a key goes in a header), and in a URL they would sit in process listings and
    configuration files; the key belongs in an environment variable named by
    ``--upstream-api-key-env`` (``api_key_env`` in a config file)."""
    url = parse_url(raw)
    if "@" in urlsplit(url).netloc:
        raise ValueError("must not carry credentials (user:password@host): put the key in an "
                         "environment variable and name it with --upstream-api-key-env "
                         "(api_key_env in a config file's [[upstream]] table)")
    return url


HEADER_NAME = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")  # an RFC 9110 token
