"""Measurement's own CPU per event, in process: this checkout against ``--before DIR``.

    python benchmarks/meter_micro.py --before /path/to/other/checkout
    python benchmarks/meter_micro.py --before DIR --streams 2000 --repeat 7 --tokens 50

Why: ``benchmarks/run.py`` prices the whole proxy (sockets, event loop, uvicorn) at
about 28 us per event, and its run-to-run noise on a shared machine is several us, so a
change of a fraction of a microsecond in the per-event measurement path cannot show
there. This runs only that path (:class:`proxy.measure.Meter` over an SSE stream, plus
what the finish reads from the timer), on the fake upstream's own event bytes, in a
child process per checkout (each imports its own ``proxy`` package), and reports the
best of ``--repeat`` runs of ``--streams`` streams, in microseconds per event, and the
ratio after/before.

Streams, each read by read as the relay hands them over (one event per read, the
closing events of chat in one read, as ``fake_upstream.py`` writes them):

* ``chat``: role chunk, tokens, then the finish chunk, the usage chunk and ``[DONE]``
  in one read (OpenAI's layout);
* ``chat-vllm``: the same, but the finish reason rides on the last token's chunk;
* ``chat-strip``: ``chat`` through :class:`proxy.strip.UsageStripper` (the proxy asked
  for the usage chunk and removes it: the default for clients that did not ask);
* ``responses`` and ``messages``: ``fake_upstream.py``'s Responses and Messages streams.

At the end of each stream the child calls ``timer.response()`` when the checkout has it
(what ``proxy.routes`` calls once per request), so its one-time decode is priced too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
API_OF = {
    "chat": "chat",
    "chat-vllm": "chat",
    "chat-strip": "chat",
    "responses": "responses",
    "messages": "messages",
}


def _sse(chunk: bytes) -> bytes:
    """The SSE bytes inside fake_upstream's HTTP chunks (``<hex>\\r\\n<bytes>\\r\\n``...)."""
    out, at = b"", 0
    while at < len(chunk):
        end = chunk.index(b"\r\n", at)
        size = int(chunk[at:end], 16)
        if size == 0:
            break
        out += chunk[end + 2 : end + 2 + size]
        at = end + 2 + size + 2
    return out


def streams(tokens: int) -> dict[str, list[bytes]]:
    """Each stream as the reads the relay hands to the meter."""
    import fake_upstream as fu

    role, token, finish = _sse(fu.ROLE), _sse(fu.TOKEN), _sse(fu.FINISH)
    usage, done = _sse(fu._usage(8, tokens)), b"data: [DONE]\n\n"
    last = token.replace(b'"finish_reason":null', b'"finish_reason":"length"')
    assert last != token
    out = {
        "chat": [role, *[token] * tokens, finish + usage + done],
        "chat-vllm": [role, *[token] * (tokens - 1), last, usage + done],
        "chat-strip": [role, *[token] * tokens, finish + usage + done],
    }
    for name, make in (("responses", fu.responses_stream), ("messages", fu.messages_stream)):
        s = make(tokens)
        out[name] = [_sse(s.before), *[_sse(s.token(i)) for i in range(tokens)], _sse(s.after)]
    return out


def child(tokens: int, count: int, repeat: int, plain: bool = False) -> dict[str, Any]:
    """Run in the checkout under test (its ``proxy`` first on sys.path). ``plain``: the
    dialects a proxy uses when nothing reads response info (no trace, OTLP metrics or
    request log), where the checkout has them, and no ``timer.response()``."""
    import proxy
    from proxy import dialects as d
    from proxy.measure import Meter, StreamTimer
    from proxy.sse import SSEParser
    from proxy.strip import UsageStripper

    table = getattr(d, "DIALECTS_WITHOUT_RESPONSE_INFO", d.DIALECTS) if plain else d.DIALECTS
    by_name = {dialect.name: dialect for dialect in table.values()}
    results: dict[str, Any] = {"proxy": str(Path(proxy.__file__).parent)}
    for name, chunks in streams(tokens).items():
        dialect = by_name[API_OF[name]]
        events = sum(c.count(b"\n\n") for c in chunks)
        best = float("inf")
        for _ in range(repeat):
            start = time.perf_counter()
            for _ in range(count):
                timer = StreamTimer(dialect)
                meter = Meter(timer, SSEParser())
                if name == "chat-strip":
                    stripper = UsageStripper(meter)
                    for i, chunk in enumerate(chunks):
                        stripper.take(chunk)
                        stripper.observe(float(i))
                else:
                    for i, chunk in enumerate(chunks):
                        meter.chunk(chunk, float(i))
                reply = None if plain else getattr(timer, "response", None)
                if reply is not None:
                    reply()
            best = min(best, time.perf_counter() - start)
        results[name] = {"us_per_event": best / (count * events) * 1e6, "events": events}
    return results


def measure(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.pop("PYTHONSTARTUP", None)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        "--tokens",
        str(args.tokens),
        "--streams",
        str(args.streams),
        "--repeat",
        str(args.repeat),
        *(["--plain"] if args.plain else []),
    ]
    done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(done.stdout)
    if Path(result["proxy"]).resolve() != (tree / "proxy").resolve():
        raise SystemExit(f"the child imported {result['proxy']}, not {tree / 'proxy'}")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", help="another checkout (its proxy/ is the baseline)")
    p.add_argument("--tokens", type=int, default=50, help="tokens per stream")
    p.add_argument("--streams", type=int, default=2000, help="streams per timed run")
    p.add_argument("--repeat", type=int, default=7, help="timed runs; the best counts")
    p.add_argument("--plain", action="store_true",
                   help="the path of a proxy with no trace, OTLP metrics or request log")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.tokens, args.streams, args.repeat, args.plain)))
        return 0
    trees = {"after": REPO}
    if args.before:
        trees["before"] = Path(args.before).resolve()
    # Alternate, so drift on a shared machine hits both alike.
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for _ in range(2):
        for name, tree in trees.items():
            runs[name].append(measure(tree, args))
    print(
        f"us of measurement per event, best of {args.repeat} x {args.streams} streams "
        f"of {args.tokens} tokens, two alternating rounds per checkout"
    )
    header = "| stream | events | after |" + (" before | after/before |" if args.before else "")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for stream in API_OF:
        after = min(r[stream]["us_per_event"] for r in runs["after"])
        row = f"| {stream} | {runs['after'][0][stream]['events']} | {after:.3f} |"
        if args.before:
            before = min(r[stream]["us_per_event"] for r in runs["before"])
            row += f" {before:.3f} | {after / before:.3f} |"
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
