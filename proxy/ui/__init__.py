"""The live page (``GET /ui``, ``GET /ui/data``) and the assets the bench report shares.

Design: ``docs/design/live-page.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from proxy.ui.breaks import RecentBreaks
from proxy.ui.page import PATHS as UI_PATHS
from proxy.ui.page import LivePage
from proxy.ui.slow import SlowRequests

if TYPE_CHECKING:
    from proxy.metrics import Metrics

__all__ = ["UI_PATHS", "LivePage", "index_scope", "live_page"]


def live_page(metrics: Metrics, *, prefix_index: dict[str, Any] | None) -> LivePage:
    """The page of a relaying process: it reads the registry that ``/metrics`` reads (with
    ``--workers``, every worker's files) and is told of each finished request for its
    slowest-requests table and its examples of where prompts broke. ``prefix_index``:
    :func:`index_scope`."""
    from proxy.metrics import multiprocess_registry
    from proxy.ui.collect import SAMPLE_NAMES

    path = metrics.options.multiprocess_dir
    # One process: only the samples the page uses are built at each reading. With
    # workers, the collector reads every file whatever is asked (and registers no names,
    # so a restricted registry would see nothing).
    registry: Any = (
        multiprocess_registry(path)
        if path is not None
        else metrics.registry.restricted_registry(SAMPLE_NAMES)
    )
    slow = SlowRequests()
    breaks = RecentBreaks()
    metrics.watchers.extend((slow.add, breaks.add))
    return LivePage(registry, slow=slow, breaks=breaks, prefix_index=prefix_index)


def index_scope(*, doctor: bool, shared: bool, workers: int) -> dict[str, Any] | None:
    """What the live page says about the doctor's index (None: the ``doctor`` is off):
    ``index`` is ``shared`` (a ``[cache-index]`` table) or ``per-process``, ``workers``
    the worker processes, and ``note`` one sentence on what a per-process index cannot
    see."""
    if not doctor:
        return None
    if shared:
        note = ("Repeats are found whichever replica or worker served the earlier request: "
                "every process shares one index ([cache-index]).")
    elif workers > 1:
        note = (f"Each of the {workers} worker processes keeps its own index and "
                "finds only the repeats it served itself (about 1 in "
                f"{workers} of a conversation's turns), and none served by another "
                "replica: a shared index ([cache-index]) finds them all.")
    else:
        note = ("This process keeps its own index: behind a load balancer it finds only the "
                "repeats it served itself (with N replicas, about 1 in N of a conversation's "
                "turns): a shared index ([cache-index]) finds them all.")
    return {"index": "shared" if shared else "per-process", "workers": workers, "note": note}
