"""Routing: which upstream takes a request, and the route label of any path.

Design: ``docs/design/request-path.md``.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Mapping, Sequence

from proxy.auth import key_header
from proxy.upstream import Gauge, LiveUpstream
from proxy.upstream_spec import UpstreamSpec, is_pattern
from proxy.wire.pool import WireTransport

NO_UPSTREAM = "none"  # the upstream label of a request no upstream takes
# Route templates for everything else under /v1: the first path segment when it is a
# known OpenAI-style resource, else a catch-all, so random paths add no label values.
KNOWN_RESOURCES = frozenset({
    "models", "embeddings", "files", "batches", "moderations", "images", "audio", "responses",
    "assistants", "threads", "vector_stores", "fine_tuning", "uploads", "rerank", "score",
    "tokenize", "detokenize", "chat", "completions", "realtime", "containers", "conversations",
})  # fmt: skip


def route_template(subpath: bytes) -> str:
    """The route label of a path under /v1 that no dialect measures."""
    segments = subpath.split(b"/")[1:]
    if not segments or segments == [b""]:
        return "/v1"
    first = segments[0].decode("latin-1")
    if first not in KNOWN_RESOURCES:
        return "/v1/{other}"
    return f"/v1/{first}" + ("/{...}" if len(segments) > 1 and any(segments[1:]) else "")


class RoutingTable:
    """Which upstream takes a request: built once per configuration, read per request.

    ``pick`` costs one dict lookup for a model seen before: the decision per
    (model, route) is cached, bounded (a client sending random model names cannot grow
    it past ``cache_size``; past it, decisions are made by the patterns each time).
    """

    def __init__(self, specs: Sequence[UpstreamSpec], cache_size: int = 4096) -> None:
        self.specs = tuple(specs)
        self.default = next((i for i, s in enumerate(self.specs) if s.default), None)
        self._cache: dict[tuple[str, str], int | None] = {}
        self._cache_size = cache_size
        # One matcher per upstream: exact names in a set, patterns compiled once.
        self._exact = [frozenset(m for m in s.models if not is_pattern(m)) for s in self.specs]
        self._patterns = [[re.compile(fnmatch.translate(m)).match for m in s.models
                           if is_pattern(m)] for s in self.specs]

    def pick(self, model: str | None, route: str) -> int | None:
        """The index of the upstream for ``model`` on ``route``, or None (answer 404)."""
        if model is None:
            return self._default_for(route)
        key = (model, route)
        found = self._cache.get(key, -1)
        if found != -1:
            return found
        chosen = self._match(model, route)
        if len(self._cache) < self._cache_size:
            self._cache[key] = chosen
        return chosen

    def _match(self, model: str, route: str) -> int | None:
        for i, spec in enumerate(self.specs):
            if not spec.serves(route):
                continue
            if model in self._exact[i] or any(m(model) for m in self._patterns[i]):
                return i
        return self._default_for(route)

    def _default_for(self, route: str) -> int | None:
        d = self.default
        if d is None or not self.specs[d].serves(route):
            return None
        return d


class LiveUpstreams:
    """Every upstream and the routing table over them; :meth:`replace` swaps both at
    once (config reload), keeping the live :class:`LiveUpstream` of every upstream whose
    settings did not change, so its pool, queue and in-flight requests carry on."""

    def __init__(self, specs: Sequence[UpstreamSpec],
                 gauge: Callable[[str], Gauge] | None = None,
                 transport: WireTransport | None = None, *, env: Mapping[str, str]) -> None:
        self._gauge = gauge
        self._env = env  # where each upstream's api_key_env is read
        self._transport = transport  # tests inject one client for a single upstream
        self.targets: tuple[LiveUpstream, ...] = ()
        self.table = RoutingTable(())
        self.replace(specs)

    def replace(self, specs: Sequence[UpstreamSpec]) -> None:
        old = {t.spec: t for t in self.targets}
        targets = tuple(old.pop(spec) if spec in old else self._target(spec) for spec in specs)
        self.targets, self.table = targets, RoutingTable(specs)
        for retired in old.values():
            retired.closing = True
            if not retired.active:
                retired.close_soon()

    def _target(self, spec: UpstreamSpec) -> LiveUpstream:
        gauge = self._gauge(spec.name) if self._gauge is not None else None
        return LiveUpstream(spec, gauge, self._transport, key_header(spec, self._env))

    def pick(self, model: str | None, route: str) -> LiveUpstream | None:
        index = self.table.pick(model, route)
        return self.targets[index] if index is not None else None

    @property
    def fallback_name(self) -> str:
        """The upstream label of a request refused before it was routed."""
        d = self.table.default
        return self.targets[d].name if d is not None else NO_UPSTREAM

    async def aclose(self) -> None:
        for target in self.targets:
            await target.client.aclose()
