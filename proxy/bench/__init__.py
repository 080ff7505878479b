"""``llm-latency-proxy bench``: a client that measures what users feel, per request.

Modules, data flowing one way: :mod:`.workload` (what to send, when) ->
:mod:`.client` (send it, time every received chunk) -> :mod:`.stats` (percentiles,
summary table) and :mod:`.promscrape` (the proxy's own view from its ``/metrics``,
scraped before and after). :mod:`.cli` wires them to the command line.

The client reuses the proxy's own SSE parser and event classifier
(:mod:`proxy.sse`, :mod:`proxy.measure`), so "first token" and "inter-token gap"
mean exactly the same thing on both sides of the wire.
"""

from __future__ import annotations
