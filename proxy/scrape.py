"""``GET /metrics`` on the main port, rendered in a worker thread, one render shared.

prometheus_client renders the exposition in Python, and the time grows with the label
sets: about 20 us per sample line here, so a registry with a client label and a few
hundred (route, model, upstream, client) sets takes a second or more
(``benchmarks/loop_micro.py scrape``, figures in ``benchmarks/RESULTS.md``). On the event
loop that whole render is a stall of every stream the proxy relays, added to the
inter-token latency it measures. In a worker thread the render still needs the GIL, but
the loop takes it back within the interpreter's switch interval (5 ms) whenever it has
something to do, instead of waiting for the whole render. With ``--workers`` the render
reads every worker's files (prometheus_client's multiprocess collector): the same
reasoning, the same thread.

One render per format at a time, shared by every scrape that can take it without
getting older figures than it asked for:

* a scrape that arrives while no render of its format is under way starts one on the
  next loop pass, and every scrape that arrives before that render begins shares it (two
  Prometheus servers scraping at the same moment cost one render);
* a scrape that arrives while a render is under way waits for it to end and shares the
  next one, so no answer holds figures read before its request arrived: a request that
  its client saw finish before scraping is always counted.

So however many scrapes pile up (a scrape timeout shorter than the render, several
Prometheus servers, a dashboard refreshing), at most one render per format runs and one
more is pending; the rest wait. Formats (plain text, OpenMetrics with its version and
name escaping) are told apart by the content type the answer will carry.
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
