"""The proxy's one HTTP/1.1 upstream client: bytes in, callbacks out.

Split as httpcore splits its client: :mod:`.errors`, :mod:`.http11` (the protocol without
the socket), :mod:`.connection`, :mod:`.keepalive` (the learned idle limit),
:mod:`.endpoint` (with the CONNECT tunnel), :mod:`.response` and :mod:`.pool`. Names are
imported from the module that defines them; this package exports nothing itself. The
design, and why the proxy has its own client: ``docs/design/upstream-client.md``.
"""
