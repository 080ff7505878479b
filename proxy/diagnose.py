"""``llm-latency-proxy diagnose``: what to fix, from one proxy or from Prometheus.

Design: ``docs/design/diagnosis.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from proxy.config import process_env, redact
from proxy.errors import CliError

if TYPE_CHECKING:
    import httpx

    from proxy.diagnosis.levers import Diagnosis, Lever
    from proxy.evidence import Reading

KEY_ENV = "LLM_PROXY_API_KEY"
DEFAULT_RANGE = "1h"
JSON_VERSION = 1
WIDTH = 88
NBSP = "\u00a0"


class SourceError(CliError):
    """The source cannot be read; the message is the one line printed."""

    exit_code = 1


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "diagnose",
        help="what to fix: the levers ranked by the time they would save, from a proxy or "
        "Prometheus",
        description=(
            "Rank what would make requests faster, per route, model and upstream: prefill of "
            "the uncached prompt, missed prompt-cache hits, queueing in the proxy and at the "
            "upstream, the fixed part of the first token, decoding speed and output length, "
            "each with the milliseconds it would save, the measured numbers behind it and "
            "one sentence. Reads one proxy's /metrics (--url) or a Prometheus server over "
            "the whole fleet (--prometheus). --json: the contract in docs/diagnose.md."
        ),
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--url", metavar="URL",
        help="The proxy's base URL (http://host:8080; /metrics is appended, a trailing /v1 "
        "dropped; a URL ending in /metrics is used as it is)")
    source.add_argument(
        "--prometheus", metavar="URL",
        help="A Prometheus server that scrapes the proxies and has the recording rules of "
        "prometheus/rules/recording.yml loaded (http://prometheus:9090)")
    parser.add_argument(
        "--window", metavar="S", type=float, default=None,
        help="With --url: diagnose the S seconds between two scrapes S apart [default: "
        "since the proxy started]")
    parser.add_argument(
        "--range", metavar="DURATION", dest="range_", default=None,
        help=f"With --prometheus: the window, a PromQL duration (5m, 1h, 1d) "
        f"[default {DEFAULT_RANGE}]")
    parser.add_argument("--route", metavar="ROUTE", help="Only this route (/v1/chat/completions)")
    parser.add_argument("--model", metavar="NAME", help="Only this model (its label value)")
    parser.add_argument("--upstream", metavar="NAME", help="Only this upstream (its name)")
    parser.add_argument("--json", action="store_true",
                        help="Print the JSON object of docs/diagnose.md instead of the card")
    parser.add_argument(
        "--api-key", metavar="KEY", default=None,
        help=f"Client key for a proxy that checks them (its main port's /metrics takes one), "
        f"sent to --url only [default: env {KEY_ENV}]")
    parser.add_argument("--timeout", metavar="S", type=float, default=10.0,
                        help="Seconds to wait for each answer [default %(default)s]")
    parser.set_defaults(func=run_command, parser=parser, error_prefix="diagnose")


def run_command(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.parser
    problem = _check(args)
    if problem:
        parser.error(problem)  # exits 2
    try:
        payload = collect(args)
    except KeyboardInterrupt:
        print("\ndiagnose: interrupted", file=sys.stderr)
        return 130
    diagnoses, source = payload
    if args.json:
        print(json.dumps(as_document(diagnoses, source), indent=2))
    else:
        print(render(diagnoses, source))
    return 0


def _check(args: argparse.Namespace) -> str:
    from proxy.evidence import duration_seconds

    target = args.url or args.prometheus
    parts = urlsplit(target)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        flag = "--url" if args.url else "--prometheus"
        return f"{flag} must be an http:// or https:// URL, not {target!r}"
    if args.window is not None:
        if args.prometheus:
            return "--window goes with --url; with --prometheus the window is --range"
        if not (math.isfinite(args.window) and args.window > 0):
            return f"--window must be a positive number of seconds, not {args.window:g}"
    if args.range_ is not None:
        if args.url:
            return "--range goes with --prometheus; with --url use --window S"
        if duration_seconds(args.range_) is None:
            return f"--range must be a PromQL duration such as 5m, 1h or 1d, not {args.range_!r}"
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        return "--timeout must be a positive number of seconds"
    return ""


# -- reading the source -------------------------------------------------------------


def collect(args: argparse.Namespace) -> tuple[list[Diagnosis], dict[str, Any]]:
    """The diagnoses and a description of the source and window."""
    import httpx

    from proxy.diagnosis.levers import diagnose
    from proxy.evidence import evidence

    filters = {"route": args.route, "model": args.model, "upstream": args.upstream}
    with httpx.Client(timeout=args.timeout) as client:
        if args.url:
            now, before, source = _from_proxy(client, args)
        else:
            now, before, source = _from_prometheus(client, args)
    found = evidence(now, before, **filters)
    if not found and any(filters.values()):
        from proxy.evidence import known_values

        known = known_values(now)
        hint = "; ".join(f"{name}s: {', '.join(values) or 'none'}"
                         for name, values in known.items() if filters[name])
        print(f"diagnose: no measured requests match "
              f"{' '.join(f'--{k} {v}' for k, v in filters.items() if v)} ({hint})",
              file=sys.stderr)
    return [diagnose(ev) for ev in found], source


def metrics_url(url: str) -> str:
    """The proxy's ``/metrics`` from the URL given (base, base/v1 or the metrics URL)."""
    from proxy.bench.promscrape import metrics_url_for

    base = url.rstrip("/")
    return base if base.endswith("/metrics") else metrics_url_for(base)


def _from_proxy(client: httpx.Client, args: argparse.Namespace
                ) -> tuple[Reading, Reading | None, dict[str, Any]]:
    url = metrics_url(args.url)

    key = args.api_key or process_env().get(KEY_ENV) or ""
    headers = {"Accept": "text/plain"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    before = None
    if args.window is not None:
        before = _scrape(client, url, headers)
        print(f"diagnose: scraped {redact(url)}; the second scrape in {args.window:g} s",
              file=sys.stderr, flush=True)
        time.sleep(args.window)  # the window the user asked for
    now = _scrape(client, url, headers)
    window = ("between_scrapes", args.window) if args.window is not None else ("since_start", None)
    return now, before, {"kind": "proxy", "url": redact(url), "window": window[0],
                         "window_s": window[1], "fit_from": "counters"}


def _request(client: httpx.Client, method: str, url: str, **kwargs: Any) -> httpx.Response:
    """The answer; a request that fails is one line. Credentials in a URL (which httpx
    sends as Basic auth) are masked wherever it is printed: the card, the JSON, errors."""
    import httpx

    try:
        return client.request(method, url, **kwargs)
    except httpx.HTTPError as exc:
        text = str(exc).strip()
        why = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
        raise SourceError(f"cannot read {redact(url)}: {why}") from None


def _scrape(client: httpx.Client, url: str, headers: dict[str, str]) -> Reading:
    from proxy.bench.promscrape import has_proxy_metrics, parse
    from proxy.evidence import read_snapshot

    where = redact(url)
    response = _request(client, "GET", url, headers=headers)
    if response.status_code == 401:
        given = "the key given was refused" if "Authorization" in headers else "none was given"
        raise SourceError(f"{where} answered 401: the proxy checks client keys and {given}; "
                          f"pass one with --api-key or {KEY_ENV}")
    if response.status_code != 200:
        raise SourceError(f"{where} answered HTTP {response.status_code}")
    snapshot = parse(response.text)
    if not has_proxy_metrics(snapshot):
        raise SourceError(f"{where} has no llm_proxy_ metrics: is it the proxy's /metrics?")
    return read_snapshot(snapshot)


def _from_prometheus(client: httpx.Client, args: argparse.Namespace
                     ) -> tuple[Reading, None, dict[str, Any]]:
    from proxy.evidence import (
        RULE_RANGES,
        duration_seconds,
        has_fit,
        matchers,
        prometheus_queries,
        prometheus_query,
        reading_from_prometheus,
    )

    base = args.prometheus.rstrip("/")
    range_ = args.range_ or DEFAULT_RANGE
    where = matchers(args.route, args.model, args.upstream)
    result = _query(client, base, prometheus_query(prometheus_queries(range_, where)))
    fit_from = "recording_rules" if range_ in RULE_RANGES else "increase"
    if fit_from == "recording_rules" and not has_fit(result):
        # the rules are not loaded here (or hold nothing yet): the counters themselves
        raw = _query(client, base, prometheus_query(
            prometheus_queries(range_, where, fit_from_rules=False)))
        if has_fit(raw):
            result, fit_from = raw, "increase"
    return reading_from_prometheus(result), None, {
        "kind": "prometheus", "url": redact(base), "window": "range", "range": range_,
        "window_s": duration_seconds(range_), "fit_from": fit_from}


def _query(client: httpx.Client, base: str, expr: str) -> list[dict[str, Any]]:
    """An instant query, sent as a form (the one query is long for a URL)."""
    url = base + "/api/v1/query"
    where = redact(url)
    response = _request(client, "POST", url, data={"query": expr})
    try:
        body = response.json()
    except ValueError:
        raise SourceError(f"{where} answered HTTP {response.status_code} without the "
                          "Prometheus API's JSON: is it a Prometheus server?") from None
    if not isinstance(body, dict) or body.get("status") != "success":
        error = body.get("error") if isinstance(body, dict) else None
        raise SourceError(f"{where} refused the query ({response.status_code}): "
                          f"{error or 'no error given'}")
    data = body.get("data") or {}
    if data.get("resultType") != "vector":
        raise SourceError(f"{where}: expected an instant vector, got {data.get('resultType')}")
    result: list[dict[str, Any]] = data.get("result") or []
    return result


# -- output -------------------------------------------------------------------------


def as_document(diagnoses: Sequence[Diagnosis], source: dict[str, Any]) -> dict[str, Any]:
    """The ``--json`` object: docs/diagnose.md."""
    from proxy.diagnosis.levers import as_json

    return {"version": JSON_VERSION, "source": source, **as_json(diagnoses)}


def _window_text(source: dict[str, Any]) -> str:
    if source["window"] == "since_start":
        return ("since the proxy started (its counters as they stand; --window S for the "
                "last S seconds)")
    if source["window"] == "between_scrapes":
        return f"the {source['window_s']:g} s between two scrapes"
    fit = ("the prefill fit from the recording rules" if source["fit_from"] == "recording_rules"
           else "the prefill fit from increase() of its counters")
    return f"the last {source['range']}, summed across replicas ({fit})"


def render(diagnoses: Sequence[Diagnosis], source: dict[str, Any]) -> str:
    """The card: one block per selection, levers ranked, each with its sentence and
    the numbers behind it. Plain text, no colour."""
    where = f"Prometheus {source['url']}" if source["kind"] == "prometheus" else source["url"]
    lines = [f"What to fix: {where}",
             *_wrap(f"window: {_window_text(source)}", 2, 4)]
    if not diagnoses:
        lines += ["", "No measured requests in this window: nothing to diagnose yet."]
    for d in diagnoses:
        lines += ["", *_block(d)]
    return "\n".join(lines)


_HEADINGS = {
    "lever": "Worth acting on, most valuable first:",
    "not_a_lever": "Measured, not worth acting on:",
    "too_little_data": "Too little data:",
    "unknown": "Not measured here:",
}


def _block(d: Diagnosis) -> list[str]:
    plural = "" if d.requests == 1 else "s"
    lines = [f"{d.route}   model {d.model}   upstream {d.upstream}   "
             f"({d.requests:,} request{plural})"]
    split = d.first_token
    if split.mean_ms is not None:
        parts = [("queue in the proxy", split.proxy_queue_ms),
                 ("queue at the upstream", split.upstream_queue_ms),
                 ("prefill", split.prefill_ms)]
        if split.missed_cache_ms is not None:
            parts.append(("missed cache", split.missed_cache_ms))
        parts.append(("rest", split.rest_ms))
        # each part kept on one line (no-break spaces inside it while wrapping)
        text = (f"first token {_dur(split.mean_ms)} = "
                + " + ".join(f"{name} {_dur(ms)}".replace(" ", NBSP) for name, ms in parts))
        lines += [line.replace(NBSP, " ") for line in _wrap(text, 2, 4)]
    if d.no_first_token:
        many = "s" if d.no_first_token != 1 else ""
        lines += _wrap(f"{d.no_first_token:,} stream{many} ended before a first token, after "
                       f"{_dur(d.no_first_token_wait_ms)} on average (the client left, queued or "
                       "waiting, or the upstream broke off, went silent or sent an error): "
                       "the first token "
                       "above leaves them out; the TTFT SLO counts those past its target", 2, 4)
    if split.capped:
        lines += _wrap("(prefill and missed cache scaled down to what the queues leave of the "
                       "mean first token: the fit predicts more there, from the streams it has "
                       "or from a line held at zero)", 4, 4)
    if split.prefill_from == "engine":
        lines += _wrap("prefill as the upstream engine timed it (its own timings)", 2, 4)
    if d.prefill_ms_per_1k_tokens is not None:
        lines += _wrap(d.fit_summary, 2, 4) + _wrap(d.fit_note, 4, 4)  # which model
    else:
        lines += _wrap(d.fit_note or "Prefill cost not known.", 2, 4)
    status = ""
    for rank, lever in enumerate(d.levers, 1):
        if lever.status != status:
            status = lever.status
            lines.append(f"  {_HEADINGS[status]}")
        lines += _lever(rank, lever)
    return lines


def _lever(rank: int, lever: Lever) -> list[str]:
    head = f"  {rank:2d}. {lever.name}"
    if lever.saves_ms is not None and lever.status in ("lever", "not_a_lever"):
        of = "the first token" if lever.acts_on == "first_token" else "the total time"
        head += f": would save {_dur(lever.saves_ms)} of {of}"
    out = [head, *_wrap(lever.sentence, 6, 6)]
    numbers = " ".join(f"{k}={_num(v)}" for k, v in lever.numbers.items())
    if numbers:
        out += _wrap(f"[{numbers}]", 6, 7)
    return out


def _wrap(text: str, indent: int, then: int) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=" " * indent,
                         subsequent_indent=" " * then, break_on_hyphens=False)


def _dur(ms: float | None) -> str:
    from proxy.diagnosis.wording import dur

    return "0 ms" if ms == 0 else dur(ms)


def _num(value: float | int | None) -> str:
    if value is None:
        return "unknown"
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(value):
        return "unknown"
    if value == int(value) and abs(value) < 1e15:
        return f"{int(value):,}"
    return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
