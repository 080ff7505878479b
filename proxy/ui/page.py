"""``GET /ui`` and ``GET /ui/data``: the live page and its JSON, over ASGI or WSGI.

Design: ``docs/design/bench.md``.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
import time
from collections.abc import Callable, Iterable
from functools import cache, partial
from http import HTTPStatus
from importlib import resources
from typing import Any
from urllib.parse import parse_qsl

from proxy.asgi import Scope, Send
from proxy.evidence import SELECTORS, Registry
from proxy.ui.breaks import RecentBreaks
from proxy.ui.collect import Selection, matches
from proxy.ui.data import BadSelection, LiveData
from proxy.ui.slow import SlowRequests
from proxy.upstream import error_body

PAGE_PATH = "/ui"
DATA_PATH = "/ui/data"
PATHS = frozenset((PAGE_PATH, PAGE_PATH + "/", DATA_PATH))
MAX_QUERY = 512

Response = tuple[int, list[tuple[str, str]], bytes]

_JSON = "application/json"
_SLOT = re.compile(r"\{\{(meta|title|css|data|js)\}\}")
_NO_STORE = ("cache-control", "no-store")


@cache
def asset(name: str) -> str:
    """One file of ``proxy/ui/static``, as shipped in the package."""
    return resources.files("proxy.ui").joinpath("static", name).read_text(encoding="utf-8")


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def inline(
    body: str,
    title: str,
    *,
    css: Iterable[str],
    js: Iterable[str],
    data: str = "",
    meta_csp: bool = False,
    connect_self: bool = False,
) -> tuple[str, str]:
    """A whole HTML document: ``page.html`` around the ``body`` asset, the named
    stylesheets and scripts inlined, ``data`` in the body's ``{{data}}`` slot; and the
    Content-Security-Policy that allows exactly those scripts and styles. With
    ``meta_csp`` the policy is also written into the page (a report opened from a file
    has no response headers)."""
    style = "\n".join(asset(name) for name in css)
    script = "\n".join(asset(name) for name in js)
    connect = "'self'" if connect_self else "'none'"
    policy = (
        f"default-src 'none'; script-src {_sha256(script)}; style-src {_sha256(style)}; "
        f"img-src data:; connect-src {connect}; base-uri 'none'; form-action 'none'"
    )
    meta = f'<meta http-equiv="Content-Security-Policy" content="{policy}">' if meta_csp else ""
    template = asset("page.html").replace("{{body}}", asset(body))
    parts = {"meta": meta, "title": title, "css": style, "data": data, "js": script}
    page = _SLOT.sub(lambda m: parts[m[1]], template)  # one pass: data cannot inject a slot
    return page, policy


def script_json(value: Any) -> str:
    """JSON safe inside a ``<script type="application/json">`` element."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c")


class LivePage:
    """The page and its data for one registry (and, in the process that relays, its
    slowest requests and where its recent prompts broke). ``prefix_index``: what the
    prompt-cache doctor's figures were found in (:func:`proxy.ui.index_scope`: a
    per-process or a shared index), answered as ``/ui/data``'s ``prefix_index``, so that
    the page can say when a per-process index sees only part of the traffic; None when
    the doctor is off."""

    def __init__(
        self,
        registry: Registry,
        *,
        slow: SlowRequests | None = None,
        breaks: RecentBreaks | None = None,
        clock: Callable[[], float] = time.perf_counter,
        prefix_index: dict[str, Any] | None = None,
    ) -> None:
        self.data = LiveData(registry, clock=clock, breaks=breaks)
        self.slow = slow
        self.prefix_index = prefix_index
        html, policy = inline(
            "ui.html",
            "llm-latency-proxy · live",
            css=["ui.css"],
            js=["charts.js", "ui.js"],
            connect_self=True,
        )
        self.html = html.encode()
        self.policy = policy + "; frame-ancestors 'none'"

    def respond(self, method: str, path: str, query: bytes) -> Response:
        if method not in ("GET", "HEAD"):
            return _error(405, f"{path} answers GET only", "method_not_allowed")
        if len(query) > MAX_QUERY:
            return _error(400, f"query string longer than {MAX_QUERY} bytes", "query_too_long")
        if path == DATA_PATH:
            return self._data(query)
        headers = [
            ("content-type", "text/html; charset=utf-8"),
            _NO_STORE,
            ("content-security-policy", self.policy),
            ("x-content-type-options", "nosniff"),
            ("referrer-policy", "no-referrer"),
        ]
        return 200, headers, self.html

    def _data(self, query: bytes) -> Response:
        try:
            selection = parse_selection(query)
        except ValueError as exc:
            return _error(400, str(exc), "invalid_selector")
        slow = self.slow.slowest(partial(matches, selection)) if self.slow is not None else None
        try:
            answer = self.data.answer(selection, slow)
        except BadSelection as exc:
            return _error(400, str(exc), "unknown_selector")
        answer["prefix_index"] = self.prefix_index
        headers = [("content-type", _JSON), _NO_STORE, ("x-content-type-options", "nosniff")]
        return 200, headers, json.dumps(answer, separators=(",", ":"), allow_nan=False).encode()

    # -- servers ---------------------------------------------------------------------

    async def asgi(self, scope: Scope, send: Send) -> None:
        """Answer on the event loop's server. ``/ui/data`` is computed in a worker
        thread: reading a registry of many series takes milliseconds (about a quarter of
        a ``/metrics`` scrape of it), and there the relay keeps the loop, the GIL passing
        back to it every few milliseconds, instead of waiting for the whole reading."""
        method, path, query = scope["method"], scope["path"], scope["query_string"]
        if path == DATA_PATH and method == "GET" and len(query) <= MAX_QUERY:
            status, headers, body = await asyncio.to_thread(self.respond, method, path, query)
        else:
            status, headers, body = self.respond(method, path, query)
        raw = [(k.encode(), v.encode()) for k, v in headers]
        raw.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": raw})
        body = b"" if method == "HEAD" else body
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def wsgi(self, fallback: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
        """A WSGI app: the page's paths here, everything else to ``fallback`` (the
        metrics port's prometheus_client app)."""

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            path = environ.get("PATH_INFO", "")
            if path not in PATHS:
                return fallback(environ, start_response)
            method = environ.get("REQUEST_METHOD", "GET")
            query = environ.get("QUERY_STRING", "").encode("latin-1")
            status, headers, body = self.respond(method, path, query)
            headers.append(("content-length", str(len(body))))
            start_response(f"{status} {HTTPStatus(status).phrase}", headers)
            return [b"" if method == "HEAD" else body]

        return app


def parse_selection(query: bytes) -> Selection:
    """``route``, ``model`` and ``upstream`` from a query string, each at most once;
    absent, empty or ``*`` selects every value."""
    try:
        pairs = parse_qsl(
            query.decode("latin-1"),
            keep_blank_values=True,
            max_num_fields=len(SELECTORS),
            errors="strict",
        )
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"bad query string: {str(exc)[:100]}") from None
    found: dict[str, str] = {}
    for name, value in pairs:
        if name not in SELECTORS:
            raise ValueError(f"unknown parameter {name[:40]!r}; use " + ", ".join(SELECTORS))
        if name in found:
            raise ValueError(f"parameter {name!r} given twice")
        found[name] = "" if value == "*" else value
    route, model, upstream = (found.get(name, "") for name in SELECTORS)
    return route, model, upstream


def _error(status: int, message: str, code: str) -> Response:
    return (
        status,
        [("content-type", _JSON), _NO_STORE],
        error_body(message, "invalid_request_error", code),
    )
