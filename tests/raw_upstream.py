"""Old import path of the raw upstream, kept for ``tests/test_wire.py``'s imports.

The raw behaviours (:class:`Conn`: a head, chunks, an RST, a FIN mid-body, waiting for
the proxy to close) are now one mode of the suite's one fake upstream,
:mod:`tests.fake_upstream`; the subprocess helpers live in :mod:`tests.servers`. New
tests import from those modules.
"""

from __future__ import annotations

from tests.fake_upstream import (
    Behaviour,
    Conn,
    Gate,
    RawUpstream,
    Seen,
    content_event,
    normal,
    stream_events,
)
from tests.servers import closed_port, proxy_process, refuses

__all__ = [
    "Behaviour",
    "Conn",
    "Gate",
    "RawUpstream",
    "Seen",
    "closed_port",
    "content_event",
    "normal",
    "proxy_process",
    "refuses",
    "stream_events",
]
