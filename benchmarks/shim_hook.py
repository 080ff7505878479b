"""The import hook both diagnostic shims use (``timing_shim/``, ``timeline_shim/``).

A shim's ``sitecustomize.py`` runs at start-up, before ``run.py``'s snapshot of
``proxy/`` is on ``sys.path``; :class:`AfterImport` waits for the named module to be
imported, from wherever the process imports it, and then calls ``install``.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from typing import Any


class AfterImport:
    """A meta path finder that calls ``install()`` once ``name`` has been executed."""

    def __init__(self, name: str, install: Callable[[], None]) -> None:
        self.name, self.install = name, install

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        execute = loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            self.install()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
