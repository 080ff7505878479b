"""llm-latency-proxy: an OpenAI-compatible reverse proxy that measures what users feel.

It relays each request to the configured upstream, re-streams the server-sent events
byte for byte as they arrive, and measures time to first token, inter-token latency,
tokens and queue time per request, exported as Prometheus histograms (prefix
``llm_proxy_``).
"""

from __future__ import annotations

__version__ = "0.1.0"
