"""``llm-latency-proxy bench``: a client that measures what users feel, per request.

Modules, data flowing one way: :mod:`.workload` (what to send, when) ->
:mod:`.client` (send it, time every received chunk) -> :mod:`.stats` (percentiles,
summary table) and :mod:`.promscrape` (the proxy's own view from its ``/metrics``,
scraped before and after). :mod:`.cli` wires them to the command line.

The client reads each API's stream (chat completions, completions, Responses,
Messages) with its own small parser, independent of the proxy's :mod:`proxy.sse` and
:mod:`proxy.measure` on purpose: it takes the proxy's definitions of "first token" and
"inter-token gap", not its code, so it can check the proxy rather than repeat it.
"""

from __future__ import annotations
