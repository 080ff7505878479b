"""``llm-latency-proxy bench``: a client that measures what users feel, per request.

Design: ``docs/design/bench.md``.
"""

from __future__ import annotations
