"""``GET /metrics`` on the main port, rendered in a worker thread, one render shared.

Design: ``docs/design/relay-and-export.md``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

Render = Callable[[str | None], tuple[bytes, str]]  # Accept header -> body, content type


@dataclass(slots=True)
class _Format:
    """The render state of one format."""

    accept: str | None = None  # the Accept header of the scrape that asked first
    pending: asyncio.Future[tuple[bytes, str]] | None = None  # shared, not begun yet
    running: bool = False


class Scrapes:
    """Answers scrapes with ``render(accept)`` run in the loop's default executor.

    ``content_type(accept)`` names the format a scrape asks for (cheap, on the loop);
    ``render(accept)`` renders it (expensive, in a thread)."""

    def __init__(self, render: Render, content_type: Callable[[str | None], str]) -> None:
        self._render = render
        self._content_type = content_type
        self._formats: dict[str, _Format] = {}
        self.renders = 0  # renders begun, for the benchmark's record

    async def __call__(self, accept: str | None) -> tuple[bytes, str]:
        """The exposition for ``accept`` and its content type."""
        key = self._content_type(accept)
        state = self._formats.get(key)
        if state is None:
            state = self._formats[key] = _Format()
        if state.pending is None:
            loop = asyncio.get_running_loop()
            state.pending = loop.create_future()
            state.accept = accept
            if not state.running:
                loop.call_soon(self._begin, state)
            # else: begun when the running render ends (see _begin's callback)
        # Shielded: a scrape whose client left stops waiting; the others still get it.
        return await asyncio.shield(state.pending)

    def _begin(self, state: _Format) -> None:
        shared = state.pending
        assert shared is not None
        state.pending = None
        state.running = True
        self.renders += 1
        try:
            work = asyncio.get_running_loop().run_in_executor(None, self._render, state.accept)
        except RuntimeError as exc:  # the executor is shut down: the loop is closing
            state.running = False
            shared.set_exception(exc)
            return

        def done(work: asyncio.Future[tuple[bytes, str]]) -> None:
            state.running = False
            if not shared.cancelled():
                error = work.exception()
                if error is not None:
                    shared.set_exception(error)
                else:
                    shared.set_result(work.result())
            if state.pending is not None:  # scrapes that arrived during this render
                self._begin(state)

        work.add_done_callback(done)
