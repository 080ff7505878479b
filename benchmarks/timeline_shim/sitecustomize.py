"""Stamps along one request's way through a running proxy, for ``benchmarks/timeline.py``.

Python imports this file at start-up when its directory is on ``PYTHONPATH``. When
``LLM_PROXY_TIMELINE`` names a file, every point of :data:`POINTS` (uvicorn's side and
the proxy's) is wrapped to append ``(label, time.perf_counter_ns())`` to the current
request's list; a new list starts when the next request's first bytes arrive, and all are
written at exit (one JSON line each), so no file write is ever timed. ``perf_counter`` is ``CLOCK_MONOTONIC`` on Linux, the clock the
client in ``timeline.py`` reads too, so the proxy's stamps and the client's share one
time line. Requests must come one at a time (the timeline's client does that).
A wrapper costs two clock reads and a list append per call, so a step's figure includes a
little of the instrument: read the steps side by side, not as absolute truths.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import inspect
import json
import os
import sys
import time
from typing import Any

_PATH = os.environ.get("LLM_PROXY_TIMELINE", "")

# (module, attribute path, label, when): "enter", "exit" or "both". A point missing in
# the code being measured (an older or newer tree) is skipped and listed in the output.
POINTS: tuple[tuple[str, str, str, str], ...] = (
    (
        "uvicorn.protocols.http.httptools_impl",
        "HttpToolsProtocol.data_received",
        "client bytes read",
        "enter",
    ),
    (
        "uvicorn.protocols.http.httptools_impl",
        "HttpToolsProtocol.on_message_begin",
        "uvicorn: message begins",
        "enter",
    ),
    (
        "uvicorn.protocols.http.httptools_impl",
        "HttpToolsProtocol.on_headers_complete",
        "uvicorn: headers complete",
        "both",
    ),
    (
        "uvicorn.protocols.http.httptools_impl",
        "HttpToolsProtocol.on_message_complete",
        "request parsed",
        "exit",
    ),
    ("uvicorn.protocols.http.httptools_impl", "RequestResponseCycle.send", "uvicorn send", "both"),
    ("proxy.routes", "V1Handler.__call__", "handler", "enter"),
    ("proxy.routes", "V1Handler._check", "checked", "exit"),
    ("proxy.routes", "V1Handler._read", "body read", "exit"),
    ("proxy.routes", "V1Handler._decode", "body decoded", "exit"),
    ("proxy.routes", "V1Handler._parse", "body parsed", "exit"),
    ("proxy.routes", "V1Handler._route", "routed", "exit"),
    ("proxy.routes", "V1Handler._admit", "admitted", "exit"),
    ("proxy.routes", "V1Handler._forward", "forward", "enter"),
    ("proxy.upstream", "UpstreamClient.open", "client.open", "enter"),
    ("proxy.wire.pool", "WireTransport.exchange", "exchange", "both"),
    ("proxy.wire.pool", "WireTransport._connection", "connection ready", "exit"),
    ("proxy.wire.pool", "WireTransport._connect", "connect", "both"),
    ("proxy.wire.connection", "Connection.start", "request written", "both"),
    ("proxy.wire.connection", "Connection.data_received", "upstream bytes read", "enter"),
    ("proxy.wire.connection", "Connection._head_received", "response head parsed", "exit"),
    ("proxy.doctor.job", "PrefixCheck.begin", "doctor begin", "both"),
    ("proxy.routes", "V1Handler._relay", "relay", "enter"),
    ("proxy.uvicorn_writer", "DirectWriter.write", "client write", "both"),
    ("proxy.measure", "StreamTimer.token", "token observed", "enter"),
    ("proxy.routes", "V1Handler._finish", "finish", "both"),
)

_requests: list[list[tuple[str, int]]] = [[]]
_done = [False]
_missing: list[str] = []


def _write(path: str) -> None:
    with open(path, "a") as out:
        for stamps in _requests:
            if stamps:
                out.write(json.dumps({"stamps": stamps, "missing": _missing}) + "\n")


def _install(path: str) -> None:
    clock = time.perf_counter_ns
    atexit.register(_write, path)

    def wrap(owner: Any, name: str, label: str, when: str) -> None:
        inner = inspect.getattr_static(owner, name)
        func = getattr(owner, name)
        first_read = label == "client bytes read"
        ends = label == "finish"
        if inspect.iscoroutinefunction(func):

            async def stamped(*args: Any, **kwargs: Any) -> Any:
                if when != "exit":
                    _requests[-1].append((label, clock()))
                try:
                    return await func(*args, **kwargs)
                finally:
                    if when != "enter":
                        _requests[-1].append(
                            (label + " done" if when == "both" else label, clock())
                        )

        else:

            def stamped(*args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
                t = clock()
                if first_read and _done[0]:
                    _done[0] = False
                    _requests.append([])
                if when != "exit":
                    _requests[-1].append((label, t))
                try:
                    return func(*args, **kwargs)
                finally:
                    if ends:
                        _done[0] = True
                    if when != "enter":
                        _requests[-1].append(
                            (label + " done" if when == "both" else label, clock())
                        )

        if isinstance(inner, staticmethod):
            stamped = staticmethod(stamped)  # type: ignore[assignment]
        setattr(owner, name, stamped)

    for module, attr, label, when in POINTS:
        try:
            owner: Any = importlib.import_module(module)
            *path_, name = attr.split(".")
            for part in path_:
                owner = getattr(owner, part)
            getattr(owner, name)
        except (ImportError, AttributeError):
            _missing.append(f"{module}:{attr}")
            continue
        wrap(owner, name, label, when)


if _PATH:
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from shim_hook import AfterImport  # benchmarks/shim_hook.py

    sys.meta_path.insert(0, AfterImport("proxy.app", lambda: _install(_PATH)))
