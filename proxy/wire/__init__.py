"""The proxy's one HTTP/1.1 upstream client: bytes in, callbacks out.

Design: ``docs/design/upstream-client.md``.
"""
