"""One request's way through the proxy, step by step, at light load: where the added
milliseconds of a first token go, beside nginx and a direct connection.

    python benchmarks/timeline.py                      # steady and after-idle, 12 rounds
    python benchmarks/timeline.py --before /tmp/before --targets direct,nginx,proxy,proxy-before

A client sends one streamed request at a time on a new connection (the fake upstream of
``run.py``: first token after ``--ttft``, then ``--tokens`` events ``--itl`` apart) in two
situations, interleaved round by round and target by target:

* **steady**: requests back to back (the target's pooled upstream connection is warm);
* **idle**: one request after ``--idle`` seconds with no traffic (longer than the proxy's
  ``--upstream-keepalive-expiry``, so its pooled connection has expired).

Every proxy target runs with ``timeline_shim/`` on ``PYTHONPATH``: it stamps each step of a
request with ``time.perf_counter_ns()`` (``CLOCK_MONOTONIC``, the clock this client reads),
so the client's and the proxy's stamps share one time line. The output is, per target and
situation, the median added TTFT against ``direct`` in the same round, and for proxy
targets the median time of each step from the client's last request byte, and of the
first token's way back. The stamps cost a little themselves: the step table explains the
added TTFT, the ``added`` figures of ``run.py`` (no shim) are the ones to quote.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from loadgen import TOKEN_MARK, LoadConfig, _request_bytes  # noqa: E402
from run import Bench, Target, machine, parse_args, start_targets  # noqa: E402

clock = time.perf_counter_ns

# The request's way in: (label, the stamp that ends the step). The first step starts at
# the client's last request byte written.
WAY_IN = (
    ("kernel + loop wake-up: uvicorn reads the request", "client bytes read"),
    ("uvicorn parses the request (httptools)", "request parsed"),
    ("uvicorn starts the ASGI task, the app dispatches", "handler"),
    ("cheap checks (path, headers, keys)", "checked"),
    ("body read (ASGI receive)", "body read"),
    ("body decoded (JSON)", "body decoded"),
    ("usage injection / re-serialization", "body parsed"),
    ("routing", "routed"),
    ("admission", "admitted"),
    ("to the forward step", "forward"),
    ("upstream headers built", "client.open"),
    ("request serialized, pool entered", "exchange"),
    ("connection: pooled or new", "connection ready"),
    ("request written to the upstream socket", "request written done"),
)
# The response head: from the request written to the client's response start.
WAY_HEAD = (
    ("upstream: response head arrives", "upstream bytes read"),
    ("response head parsed", "response head parsed"),
    ("exchange returns", "exchange done"),
    ("doctor's job created", "doctor begin done"),
    ("relay set up", "relay"),
    ("response start sent (uvicorn send)", "uvicorn send done"),
)


def one_request(host: str, port: int, request: bytes, timeout: float) -> dict[str, int]:
    """One stream on a new connection; the client's stamps in perf_counter ns."""
    t_conn = clock()
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # The origin: the request handed to the kernel. Read before the call, since the
        # client may be descheduled after it while the proxy already works on the request.
        t_sent = clock()
        sock.sendall(request)
        t_first = 0
        seen = b""
        while True:
            data = sock.recv(65536)
            t = clock()
            if not data:
                break
            if not t_first and TOKEN_MARK in data:
                t_first = t
            seen = (seen + data)[-64:]
            if b"[DONE]" in seen and seen.endswith(b"0\r\n\r\n"):
                break
    if not t_first:
        raise RuntimeError("stream without a token")
    return {"conn": t_conn, "sent": t_sent, "first": t_first, "end": clock()}


def read_stamps(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def steps_of(stamps: list[list[Any]], client: dict[str, int]) -> dict[str, float] | None:
    """Microseconds per step of one request, from its stamps and the client's."""
    # What the proxy did after the request finished (a pooled connection kept warm while
    # the next request had not come yet) is not this request's.
    end = next((i for i, (label, _) in enumerate(stamps) if label == "finish done"), None)
    stamps = stamps[: end + 1] if end is not None else stamps
    first: dict[str, int] = {}
    for label, t in stamps:
        first.setdefault(label, t)
    token_t = next((t for label, t in stamps if label == "token observed"), None)
    if token_t is None or "request written done" not in first:
        return None
    out: dict[str, float] = {}
    prev = client["sent"]
    for name, label in WAY_IN:
        if label in first:
            out[name] = (first[label] - prev) / 1000
            prev = first[label]
    if "connect" in first:
        out["  of which connect (new connection)"] = (
            first["connect done"] - first["connect"]
        ) / 1000
    prev = first["request written done"]
    after = [(label, t) for label, t in stamps if t >= prev]
    after_first: dict[str, int] = {}
    for label, t in after:
        after_first.setdefault(label, t)
    for name, label in WAY_HEAD:
        if label in after_first:
            out[name] = (after_first[label] - prev) / 1000
            prev = after_first[label]
    reads = [t for label, t in stamps if label == "upstream bytes read" and t <= token_t]
    writes = [t for label, t in stamps if label == "client write" and t <= token_t]
    if reads and writes:  # the write's own send() is in the next step: the client may
        # read the bytes before the proxy's call returns
        out["first token: upstream bytes read -> its write to the client begins"] = (
            writes[-1] - reads[-1]
        ) / 1000
        out["first token: write begins -> client reads it"] = (client["first"] - writes[-1]) / 1000
    # llm_proxy_overhead_seconds as the proxy records it: handler entry to request written
    out["the overhead metric's span (handler -> request written)"] = (
        first["request written done"] - first["handler"]
    ) / 1000
    out["way in: client's last byte -> request written upstream"] = (
        first["request written done"] - client["sent"]
    ) / 1000
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default="direct,nginx,proxy")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steady", type=int, default=3, help="back-to-back requests per round")
    p.add_argument("--idle", type=float, default=6.0, help="seconds without traffic")
    p.add_argument("--ttft", type=float, default=0.1)
    p.add_argument("--itl", type=float, default=0.02)
    p.add_argument("--tokens", type=int, default=50)
    p.add_argument("--prompt-bytes", type=int, default=2000)
    p.add_argument("--before", default="", help="checkout for proxy-before targets")
    p.add_argument("--proxy-arg", action="append", default=[])
    p.add_argument("--nice", type=int, default=0)
    p.add_argument("--json", default="", help="write every request's figures here")
    a = p.parse_args(argv)
    run_args = parse_args(
        [
            "--ttft",
            str(a.ttft),
            "--itl",
            str(a.itl),
            "--tokens",
            str(a.tokens),
            "--nice",
            str(a.nice),
            "--max-minutes",
            "60",
            *(["--before", a.before] if a.before else []),
            *[f"--proxy-arg={x}" for x in a.proxy_arg],
        ]
    )
    names = [t.strip() for t in a.targets.split(",") if t.strip()]
    if "direct" not in names:
        names.insert(0, "direct")
    bench = Bench(run_args)
    stamp_files: dict[str, Path] = {}
    results: list[dict[str, Any]] = []
    missing_points: dict[str, list[str]] = {}
    targets: list[Target] = []
    try:
        shim = str(HERE / "timeline_shim")
        for name in names:
            if name.startswith("proxy"):
                stamp_files[name] = bench.tmp / f"{name}.timeline.jsonl"
                os.environ["LLM_PROXY_TIMELINE"] = str(stamp_files[name])
                os.environ["PYTHONPATH"] = shim
            try:
                if not targets:  # direct: the fake upstream itself
                    targets += start_targets(bench, [name], False)
                else:
                    targets += start_targets_in_front(bench, name, targets[0])
            finally:
                os.environ.pop("LLM_PROXY_TIMELINE", None)
                os.environ.pop("PYTHONPATH", None)
        cfg = LoadConfig(url="", tokens=a.tokens, keepalive=False, prompt_bytes=a.prompt_bytes)
        requests = {}
        for t in targets:
            host, port, req = _request_bytes(LoadConfig(**{**cfg.__dict__, "url": t.url}))
            requests[t.name] = (host, port, req)
            for _ in range(3):  # imports, first connections
                one_request(host, port, req, 30)
        for rnd in range(a.rounds):
            k = rnd % len(targets)
            order = targets[k:] + targets[:k]
            for situation in ("steady", "idle"):
                for t in order:
                    host, port, req = requests[t.name]
                    if situation == "idle":
                        time.sleep(a.idle)
                        runs = [one_request(host, port, req, 30)]
                    else:
                        runs = [one_request(host, port, req, 30) for _ in range(a.steady)][1:]
                    for r in runs:
                        results.append(
                            {"round": rnd, "situation": situation, "target": t.name, **r}
                        )
            print(f"# round {rnd + 1}/{a.rounds} done", file=sys.stderr)
    finally:
        for t in targets:  # the stamps are written at exit
            if t.name in stamp_files and t.proc is not None:
                os.killpg(t.proc.pid, signal.SIGTERM)
                t.proc.wait(15)
        stamps = {name: read_stamps(path) for name, path in stamp_files.items()}
        bench.close()
    for name, lines in stamps.items():
        mine = [r for r in results if r["target"] == name]
        for r in mine:
            line = next(
                (s for s in lines if s["stamps"] and r["conn"] <= s["stamps"][0][1] <= r["end"]),
                None,
            )
            r["steps"] = steps_of(line["stamps"], r) if line else None
            r["stamps"] = line["stamps"] if line else None
        missing = lines[0]["missing"] if lines else ["no stamps at all"]
        missing_points[name] = missing
        if missing:
            print(f"# {name}: points not found: {', '.join(missing)}", file=sys.stderr)
    report(results, names, a)
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "args": vars(a),
                    "machine": machine(),
                    "missing_points": missing_points,
                    "results": results,
                },
                indent=1,
            )
        )
    return 0


def start_targets_in_front(bench: Bench, name: str, direct: Target) -> list[Target]:
    """``name`` in front of the running fake upstream (``direct``)."""
    if name == "nginx":
        return [bench.start_nginx(direct.url)]
    extra = []
    before = False
    for part in name.split("-")[1:]:
        if part == "before":
            before = True
        elif part == "nodoctor":
            extra.append("--no-prefix-doctor")
        else:
            raise SystemExit(f"unknown target {name!r}")
    return [bench.start_proxy(direct.url, name, extra, before=before)]


def report(results: list[dict[str, Any]], names: list[str], a: argparse.Namespace) -> None:
    def ttft(r: dict[str, Any]) -> float:
        return (r["first"] - r["sent"]) / 1e6

    print(
        f"\nrounds {a.rounds}, idle {a.idle:g} s, prompt {a.prompt_bytes} bytes, "
        f"ttft {a.ttft:g} s, one request at a time on a new connection\n"
    )
    print(
        "| target | situation | requests | TTFT p50 ms | added TTFT p50 ms (vs direct, same round) |"
    )
    print("|---|---|---|---|---|")
    for situation in ("steady", "idle"):
        for name in names:
            mine = [r for r in results if r["target"] == name and r["situation"] == situation]
            if not mine:
                continue
            added = []
            for rnd in {r["round"] for r in mine}:
                d = [
                    ttft(r)
                    for r in results
                    if r["target"] == "direct" and r["situation"] == situation and r["round"] == rnd
                ]
                m = [ttft(r) for r in mine if r["round"] == rnd]
                if d and m:
                    added.append(statistics.median(m) - statistics.median(d))
            med_added = f"{statistics.median(added):.3f}" if added and name != "direct" else "-"
            print(
                f"| {name} | {situation} | {len(mine)} | "
                f"{statistics.median(ttft(r) for r in mine):.3f} | {med_added} |"
            )
    for name in names:
        if not name.startswith("proxy"):
            continue
        print(f"\n{name}: median microseconds per step (stamped run)\n")
        print("| step | steady us | idle us |")
        print("|---|---|---|")
        labels: list[str] = []
        for r in results:
            if r["target"] == name and r.get("steps"):
                labels += [k for k in r["steps"] if k not in labels]
        for label in labels:
            cells = []
            for situation in ("steady", "idle"):
                vals = [
                    r["steps"][label]
                    for r in results
                    if r["target"] == name
                    and r["situation"] == situation
                    and r.get("steps")
                    and label in r["steps"]
                ]
                cells.append(f"{statistics.median(vals):.0f} ({len(vals)})" if vals else "-")
            print(f"| {label} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    raise SystemExit(main())
