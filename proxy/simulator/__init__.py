"""Simulated LLM upstream: the demo's, the compose file's and the tests' LLM; and its
named speed profiles, the simulator as upstreams of clearly different speeds.

Design: ``docs/design/simulator.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from proxy.simulator.model import ConfigError, LatencyModel, SimConfig

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = [
    "PROFILES",
    "ConfigError",
    "LatencyModel",
    "SimConfig",
    "SpeedProfile",
    "create_profile_app",
    "create_simulator_app",
    "profile_config",
]

SPEED_FIELDS: tuple[str, ...] = ("prefill_overhead", "prefill_rate", "itl", "itl_growth")


@dataclass(frozen=True, slots=True)
class SpeedProfile:
    """The speed fields of a :class:`SimConfig`, under a name."""

    name: str
    prefill_overhead: float  # seconds added to every TTFT
    prefill_rate: float  # uncached prompt tokens per second
    itl: float  # seconds per decode step, one stream alone
    itl_growth: float  # fractional ITL increase per further active stream

    def fields(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in SPEED_FIELDS}

    def apply(self, base: SimConfig) -> SimConfig:
        return replace(
            base,
            prefill_overhead=self.prefill_overhead,
            prefill_rate=self.prefill_rate,
            itl=self.itl,
            itl_growth=self.itl_growth,
        )

    def describe(self) -> str:
        """One line with the figures, for start-up messages and ``--help``."""
        return (
            f"TTFT {self.prefill_overhead * 1000:g} ms + prompt tokens / "
            f"{self.prefill_rate:g} tok/s, ITL {self.itl * 1000:g} ms "
            f"({1 / self.itl:g} tok/s alone)"
        )


PROFILES: Mapping[str, SpeedProfile] = MappingProxyType(
    {
        "fast": SpeedProfile(
            "fast", prefill_overhead=0.03, prefill_rate=20_000.0, itl=0.01, itl_growth=0.005
        ),
        "slow": SpeedProfile(
            "slow", prefill_overhead=0.5, prefill_rate=2_500.0, itl=0.05, itl_growth=0.02
        ),
    }
)


def get_profile(name: str) -> SpeedProfile:
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(PROFILES)
        raise ConfigError(f"--profile: unknown speed profile {name!r} (known: {known})") from None


def profile_config(name: str, base: SimConfig | None = None) -> SimConfig:
    """``base`` (default: ``SimConfig()``) with profile ``name``'s speed fields.

    Raises :class:`ConfigError` for an unknown name.
    """
    return get_profile(name).apply(base if base is not None else SimConfig())


def create_profile_app(name: str, base: SimConfig | None = None, **seams: Any) -> FastAPI:
    """The simulator app for profile ``name`` on top of ``base``; ``seams`` (``model``,
    ``clock``, ``wall_clock``, ``sleep``) go to :func:`create_simulator_app` unchanged.
    ``app.state.config`` is the resulting :class:`SimConfig`."""
    from proxy.simulator.app import create_simulator_app

    return create_simulator_app(profile_config(name, base), **seams)


def __getattr__(name: str) -> object:
    # The web stack is imported only when the app is asked for (keeps --help fast).
    if name == "create_simulator_app":
        from proxy.simulator.app import create_simulator_app

        return create_simulator_app
    raise AttributeError(name)
