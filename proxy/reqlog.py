"""Per-request log: one JSON line per finished request (``--log-requests``).

Every measured field, the request id, route, model label, status and outcome. The
record it writes holds no headers, no key and no prompt text, so nothing secret can
reach the file. Lines are written whole and flushed, so a tailing reader never sees
half a line.
"""

from __future__ import annotations

import json
import sys
import time
from typing import TextIO

from proxy.measure import RequestRecord


class RequestLog:
    def __init__(self, target: str) -> None:
        self._own = target not in ("-", "stdout")
        self._fh: TextIO = open(target, "a", encoding="utf-8") if self._own else sys.stdout  # noqa: SIM115

    def write(self, record: RequestRecord) -> None:
        line = record.as_log()
        line["time"] = time.time()  # wall-clock timestamp of the line, not a duration
        self._fh.write(json.dumps(line, separators=(",", ":")) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._own:
            self._fh.close()
