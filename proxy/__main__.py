"""``python -m proxy`` does exactly what the ``llm-latency-proxy`` command does."""

from __future__ import annotations

from proxy.cli import main

raise SystemExit(main())
