"""Tracing's own CPU per request, in process: off, ratio 0.1, ratio 1.0.

    python benchmarks/tracing_micro.py
    python benchmarks/tracing_micro.py --requests 20000 --repeat 7 --tokens 50

Why: ``benchmarks/run.py`` prices the whole proxy at about 28 us per event with
run-to-run noise of several us on a shared 2-core machine, so a cost of a few percent
cannot be told from noise there (RESULTS.md, "OpenTelemetry tracing"). This runs exactly
what the proxy adds per measured request when tracing is on, with the SDK the proxy uses:
:meth:`proxy.tracing.Tracing.start` on the client's headers (a ``traceparent`` half the
time), :meth:`~proxy.tracing.Tracing.inject` into the upstream headers and
:meth:`~proxy.tracing.Tracing.finish` with a full record, the span going through the
same ``BatchSpanProcessor`` to an exporter that discards the batch (the network export
happens on the processor's own thread in the proxy too, so its cost is reported
separately, as the CPU of the whole process, below).

It reports, best of ``--repeat`` runs, the process CPU per request and that cost spread
over ``--tokens`` events (a 50-token stream has about 52 events), and that figure as a
share of ``--per-event-us`` (the proxy's whole CPU per event at 64 streams, 28 us in
RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from typing import Any


def run(sampler: str, arg: str, requests: int, repeat: int) -> float:
    """Best per-request CPU seconds for one sampler setting."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from proxy.measure import Outcome, RequestRecord
    from proxy.tracing import Tracing, upstream_attributes

    class Discard(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    os.environ["OTEL_TRACES_SAMPLER"] = sampler
    os.environ["OTEL_TRACES_SAMPLER_ARG"] = arg
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Discard()))
    tracing = Tracing(provider, clock=time.perf_counter, upstream="http://127.0.0.1:8000/v1",
                      propagate=True)
    attrs = upstream_attributes("http://127.0.0.1:8000/v1")
    parent = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    headers = [[(b"content-type", b"application/json"), (b"authorization", b"Bearer x")],
               [(b"content-type", b"application/json"), (b"traceparent", parent)]]
    upstream_headers = [(b"content-type", b"application/json"), (b"accept-encoding", b"identity")]
    record = RequestRecord(
        request_id="0123456789abcdef0123456789abcdef", route="/v1/chat/completions",
        model="m", upstream="u", stream=True, status=200, outcome=Outcome.COMPLETED,
        duration_s=1.0, overhead_s=0.0001, queue_s=0.0, ttft_s=0.05, ttfa_s=0.05,
        ttfb_s=0.01, tpot_s=0.02, prompt_tokens=100, completion_tokens=50,
        cached_prompt_tokens=0, response_id="chatcmpl-1", response_model="m",
        finish_reasons=("stop",))
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        for i in range(requests):
            trace = tracing.start(headers[i & 1], time.perf_counter(), "chat")
            tracing.inject(trace, upstream_headers)
            tracing.finish(trace, record, "m", attrs)
        provider.force_flush()
        best = min(best, (time.process_time() - start) / requests)
    provider.shutdown()
    return best


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=50, help="events per stream [50]")
    parser.add_argument("--per-event-us", type=float, default=28.0,
                        help="the proxy's whole CPU per event at 64 streams [28.0]")
    args = parser.parse_args(argv)
    events = args.tokens + 2  # role chunk and the closing read
    print("| tracing | CPU us per request | us per event (50-token stream) | share of "
          f"{args.per_event_us:g} us/event |")
    print("| --- | --- | --- | --- |")
    for name, sampler, arg in (("ratio 0.1", "parentbased_traceidratio", "0.1"),
                               ("ratio 1.0", "parentbased_always_on", "1"),
                               ("ratio 0.1, no parent", "traceidratio", "0.1")):
        per_request = run(sampler, arg, args.requests, args.repeat) * 1e6
        per_event = per_request / events
        print(f"| {name} | {per_request:.1f} | {per_event:.2f} | "
              f"{100 * per_event / args.per_event_us:.1f} % |")
    print("(tracing off: no Tracing object exists and the request path skips it: 0)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
