"""Security promises: bounded label cardinality, no secret in any output, the optional
server-held upstream key, no path trick reaching another host or escaping the
upstream's base path, and ``/metrics`` on a port of its own.

The cardinality test drives the app in-process (thousands of requests) in front of the
suite's scripted upstream on loopback, so the production upstream client carries them;
the others are end to end: the proxy in a real uvicorn server (or the real command in
a subprocess where its logs and ports are the subject) in front of a recording raw
upstream (:class:`tests.fake_upstream.RawUpstream`, on a thread of its own).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import posixpath
import random
import re
import signal
import string
import time
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import quote, unquote

import anyio
import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from proxy.routing import KNOWN_RESOURCES
from tests.fake_upstream import Conn, RawUpstream, ScriptedClock, stream_events
from tests.servers import closed_port, proxy_process
from tests.test_faults import chat, client, run_proxy, still_serves
from tests.upstream_fakes import UPSTREAM_LABEL, make_app

pytestmark = pytest.mark.anyio



# ---------------------------------------------------------------------------
# Cardinality


async def _events(events: list[bytes]) -> AsyncIterator[bytes]:
    for event in events:
        yield event


async def _answer(request: httpx.Request) -> httpx.Response:
    """A stream when one is asked for, else a small JSON object."""
    try:
        body = json.loads(request.content)
    except (ValueError, RecursionError):
        body = None
    if isinstance(body, dict) and body.get("stream") is True:
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=_events(stream_events(2, usage=True)))
    return httpx.Response(200, json={"ok": True})


def _label_values(registry: CollectorRegistry) -> tuple[int, dict[str, set[str]]]:
    series = 0
    values: dict[str, set[str]] = {}
    for family in registry.collect():
        for sample in family.samples:
            series += 1
            for key, value in sample.labels.items():
                values.setdefault(key, set()).add(value)
    return series, values


async def test_thousands_of_random_models_and_paths_keep_series_bounded() -> None:
    rng = random.Random(20261129)
    alphabet = string.ascii_letters + string.digits + "-_.:/ éü💥"
    max_models = 20
    app, registry = make_app(_answer, ScriptedClock(), max_models=max_models)
    tokens: set[str] = set()  # every random string the "scanner" sent

    def rand(n: int, chars: str = alphabet) -> str:
        text = "".join(rng.choice(chars) for _ in range(n))
        tokens.add(text)
        return text

    async with app, httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                      base_url="http://proxy") as c:
        async def one(i: int) -> None:
            kind = i % 4
            headers = {"x-model": rand(8, string.ascii_letters), "user-agent": rand(8, string.ascii_letters)}  # never label sources
            if kind == 0:
                await c.post("/v1/chat/completions", headers=headers,
                             json={"model": rand(12), "stream": i % 8 == 0, "messages": []})
            elif kind == 1:
                await c.post("/v1/completions", headers=headers,
                             json={"model": rand(300) if i % 3 else rand(5), "prompt": "x"})
            elif kind == 2:
                seg = "/".join(rng.choice([quote(rand(6), safe=""), "models", "files", "x" * 50])
                               for _ in range(rng.randint(1, 4)))
                await c.request(rng.choice(["GET", "POST", "DELETE", "PATCH"]), "/v1/" + seg,
                                headers=headers)
            else:
                await c.get("/" + quote(rand(10), safe=""), headers=headers)

        for start in range(0, 1200, 100):
            await asyncio.gather(*(one(i) for i in range(start, start + 100)))
        # every request under /v1 was answered and counted: the upstream's or a refusal
        answered = sum(s.value for f in registry.collect() for s in f.samples
                       if s.name == "llm_proxy_requests_total")
        assert answered == 900  # 1200 less the 300 outside /v1 (kind 3)

    series, values = _label_values(registry)
    models = values["model"]
    assert len(models) <= max_models + 2  # the first N, plus "other" and "unknown"
    assert "other" in models  # the cap was reached and applied
    templates = {"/v1", "/v1/{other}", "/v1/chat/completions", "/v1/completions"}
    templates |= {f"/v1/{r}" for r in KNOWN_RESOURCES} | {f"/v1/{r}/{{...}}" for r in KNOWN_RESOURCES}
    assert values["route"] <= templates
    assert values["upstream"] == {UPSTREAM_LABEL}
    assert all(v.isdigit() for v in values["code"])
    # No label value at all came from a client header or a raw path segment.
    leaked = {v for vs in values.values() for v in vs} & (tokens - models)
    assert not leaked
    # The bound: per metric family, at most (models x routes x stream x codes x outcomes);
    # 1,200 random requests make about 7,200 series across the 17 families (TTFT, first
    # answer, first byte and duration have 25 samples a child, token histograms 21).
    assert series < 8000, f"{series} series"


# ---------------------------------------------------------------------------
# Secrets never appear in logs, metrics, exemplars or error messages


@pytest.mark.e2e
async def test_secrets_never_appear_in_logs_metrics_or_errors(tmp_path: Path) -> None:
    nonce = f"{random.getrandbits(64):016x}"
    secrets = {
        "authorization": f"Bearer sk-LEAK-AUTH-{nonce}",
        "api-key": f"LEAK-APIKEY-{nonce}",
        "x-org-secret": f"LEAK-CUSTOM-{nonce}",
    }
    needles = [f"sk-LEAK-AUTH-{nonce}", f"LEAK-APIKEY-{nonce}", f"LEAK-CUSTOM-{nonce}"]

    async def drop(conn: Conn) -> None:
        await conn.head(200)
        await conn.chunk(stream_events(1, usage=False)[1])
        conn.reset()

    async def refuse(conn: Conn) -> None:
        body = b'{"error":{"message":"Incorrect API key provided","type":"invalid_request_error"}}'
        await conn.head(401, content_type="application/json", length=len(body))
        await conn.write(body)

    upstream = RawUpstream({"drop": drop, "refuse": refuse})
    metrics_port = closed_port()
    seen_by_client: list[str] = []
    with upstream.running():
        # (Credentials in the upstream URL stop start-up: tests/test_keys.py.)
        async with proxy_process(
                upstream.url, "--log-requests", "-", "--access-log",
                "--secret-headers", "X-Org-Secret", "--metrics-port", str(metrics_port),
                "--max-body-bytes", "4096", "--read-timeout", "2") as (proc, port, out):
            base = f"http://127.0.0.1:{port}"
            async with client() as c:
                requests = [
                    ("POST", "/v1/chat/completions", chat("ok")),
                    ("POST", "/v1/chat/completions", chat("ok", stream=False)),
                    ("POST", "/v1/chat/completions", chat("drop")),
                    ("POST", "/v1/chat/completions", chat("refuse")),
                    ("GET", "/v1/models", b""),
                    ("GET", "/v1/%2e%2e/admin", b""),  # the proxy's own 400
                    ("POST", "/v1/chat/completions", b"x" * 5000),  # the proxy's own 413
                    ("GET", "/nowhere", b""),  # the proxy's own 404
                ]
                for method, path, body in requests:
                    try:
                        r = await c.request(method, base + path, content=body, headers=secrets)
                        seen_by_client.append(str(r.status_code) + str(r.headers) + r.text)
                    except httpx.HTTPError as exc:
                        seen_by_client.append(repr(exc))
                for accept in ("text/plain", "application/openmetrics-text; version=1.0.0"):
                    r = await c.get(f"http://127.0.0.1:{metrics_port}/metrics",
                                    headers={"accept": accept, **secrets})
                    assert r.status_code == 200
                    seen_by_client.append(r.text)
                assert "# EOF" in seen_by_client[-1] and "request_id=" in seen_by_client[-1]
            proc.send_signal(signal.SIGTERM)
            await anyio.to_thread.run_sync(proc.wait, 10)
        # The headers did reach the upstream (client keys pass through by default) ...
        assert upstream.requests[0].header("authorization") == secrets["authorization"]
    logs = "".join(out)
    # ... and the captured output really is the proxy's logs: one JSON line per request
    # that reached the handler, and uvicorn's access log lines.
    records = [json.loads(line) for line in out if line.startswith("{")]
    assert sorted((r["status"], r["outcome"]) for r in records) == [
        (200, "completed"), (200, "completed"), (200, "completed"),  # stream, JSON, models
        (200, "upstream_interrupted"),  # drop
        (400, "rejected"),  # the proxy's own 400 (path)
        (401, "upstream_4xx"),  # refuse
        (413, "rejected"),  # the proxy's own 413 (body); the 404 is outside /v1/*
    ]
    assert "GET /v1/models" in logs
    for needle in needles:
        assert needle not in logs, f"secret in the logs: {needle}"
        for text in seen_by_client:
            assert needle not in text, f"secret echoed to the client or in metrics: {needle}"


# ---------------------------------------------------------------------------
# Server-held upstream key


@pytest.mark.e2e
async def test_server_held_key_checks_clients_and_sends_only_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    client_key = "cli-" + "".join(random.choices(string.ascii_letters, k=24))
    server_key = "srv-" + "".join(random.choices(string.ascii_letters, k=24))
    monkeypatch.setenv("TEST_UPSTREAM_KEY", server_key)
    keys = tmp_path / "keys"
    keys.write_text("# proxy clients\nsha256:" + hashlib.sha256(client_key.encode()).hexdigest()
                    + "\n" + hashlib.sha256(b"another-client").hexdigest() + "\n")
    upstream = RawUpstream()
    with upstream.running(), run_proxy(upstream.url, upstream_api_key_env="TEST_UPSTREAM_KEY",
                                       client_keys_file=str(keys),
                                       secret_headers=("x-org-secret",)) as (proxy, _):
        async with client() as c:
            for headers in ({}, {"authorization": "Bearer wrong-key"},
                            {"authorization": f"Basic {client_key}"},
                            {"api-key": client_key[:-1]},
                            {"authorization": f"Bearer {server_key}"}):
                r = await c.post(proxy.url + "/v1/chat/completions", content=chat("ok"),
                                 headers=headers)
                assert r.status_code == 401, headers
                err = r.json()["error"]
                assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key"
                assert "wrong-key" not in r.text and client_key not in r.text
            assert upstream.requests == []  # nothing reached the upstream
            # Azure-style api-key header, plus a configured secret header:
            r = await c.post(proxy.url + "/v1/chat/completions", content=chat("ok"),
                             headers={"api-key": client_key, "x-org-secret": "s3"})
            assert r.status_code == 200
        # The official SDK with the right key (Authorization: Bearer).
        async with openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=client_key,
                                      max_retries=0) as sdk:
            reply = await sdk.chat.completions.create(
                model="ok", messages=[{"role": "user", "content": "hi"}])
            assert reply.choices[0].message.content == "hi"
        await still_serves_with_key(proxy.url, client_key)
    assert len(upstream.requests) == 3
    for seen in upstream.requests:
        assert seen.header("authorization") == f"Bearer {server_key}"
        assert seen.header("api-key") is None and seen.header("x-org-secret") is None
        assert all(client_key.encode() not in v for _, v in seen.headers)


async def still_serves_with_key(base: str, key: str) -> None:
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0) as sdk:
        stream = await sdk.chat.completions.create(
            model="ok", messages=[{"role": "user", "content": "hi"}], stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == " tok0 tok1 tok2"


# ---------------------------------------------------------------------------
# Path tricks


async def _raw_target(port: int, target: str, host: str = "proxy.test") -> int:
    """Send ``GET <target>`` exactly as written (no client normalization); return the status."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {target} HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n"
                     .encode("latin-1"))
        await writer.drain()
        async with asyncio.timeout(10):
            response = await reader.read()
    finally:
        writer.close()
    match = re.match(rb"HTTP/1\.1 (\d{3})", response)
    return int(match[1]) if match else 0  # 0: the server dropped the request line


@pytest.mark.e2e
async def test_path_tricks_never_reach_another_host_or_escape_base_path() -> None:
    evil = RawUpstream()
    upstream = RawUpstream()
    with evil.running(), upstream.running(), run_proxy(upstream.url + "/tenant") as (proxy, _):
        e = f"127.0.0.1:{evil.port}"
        targets = [
            "/v1/../x", "/v1/../../etc/passwd", "/v1/%2e%2e/x", "/v1/%2E%2E/%2e%2E/x",
            "/v1/.%2e/x", "/v1/models/../../x", "/v1/./models", "/v1/models%2F..%2F..%2Fx",
            "/v1%2F..%2Fx", "/v1/..%2Fx", "/v1/..%5Cx", "/v1/%5C..%5Cx", "/v1\\..\\x",
            "/v1/models\\..\\..\\x", "/v1/%00/x", "/v1/models#/../x",
            f"http://{e}/v1/models", "http://evil.example/v1/models",
            f"//{e}/v1/models", f"/v1//{e}/models", f"/v1/@{e}/models",
            f"/v1/models?next=http://{e}/", "/v1/models?%2e%2e/%2e%2e/x",
            "/x/../v1/models", "/%2e%2e/v1/models",
        ]
        statuses = {t: await _raw_target(proxy.port, t, host=e) for t in targets}
        async with client() as c:
            assert (await c.get(proxy.url + "/v1/models")).status_code == 200
    assert evil.requests == [] and evil.connections == 0, "the proxy reached another host"
    base = "/tenant/v1/"
    for seen in upstream.requests:
        path = seen.target.split("?", 1)[0]
        assert path.startswith(base), seen.target
        assert posixpath.normpath(unquote(path)).startswith(base.rstrip("/")), seen.target
        assert "\\" not in unquote(path) and "%2f" not in path.lower(), seen.target
        assert seen.header("host") == f"127.0.0.1:{upstream.port}"
    for target in ("/v1/../x", "/v1/%2e%2e/x", "/v1/models%2F..%2F..%2Fx", "/v1/..%5Cx",
                   "/v1/.%2e/x", "/v1/%00/x"):
        assert statuses[target] == 400, (target, statuses[target])
    # Absolute-form targets are served by the configured upstream, never the named host.
    assert statuses["http://evil.example/v1/models"] in (200, 400)
    assert all(s != 502 for s in statuses.values()), statuses


# ---------------------------------------------------------------------------
# /metrics on its own port


@pytest.mark.e2e
async def test_metrics_port_serves_metrics_and_main_port_does_not() -> None:
    metrics_port = closed_port()
    upstream = RawUpstream()
    with upstream.running():
        async with proxy_process(upstream.url, "--metrics-port", str(metrics_port)) as (proc, port, _):
            await still_serves(f"http://127.0.0.1:{port}")
            async with client() as c:
                main = await c.get(f"http://127.0.0.1:{port}/metrics")
                assert main.status_code == 404
                assert "llm_proxy_" not in main.text
                deadline = time.monotonic() + 5
                while True:  # the record is made just after the client saw the end
                    side = await c.get(f"http://127.0.0.1:{metrics_port}/metrics")
                    assert side.status_code == 200
                    answered = sum(
                        s.value for fam in text_string_to_metric_families(side.text)
                        for s in fam.samples
                        if s.name == "llm_proxy_requests_total" and s.labels.get("code") == "200")
                    if answered == 1:
                        break
                    assert time.monotonic() < deadline, side.text
                    await anyio.sleep(0.01)
            proc.send_signal(signal.SIGTERM)
            assert await anyio.to_thread.run_sync(proc.wait, 10) == 0
