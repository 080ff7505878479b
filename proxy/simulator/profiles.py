"""Named speed profiles: the simulator as upstreams of clearly different speeds.

A proxy in front of several upstreams is only worth watching if the upstreams differ,
and the dashboard's "compare upstreams" row and the per-upstream alerts are only
proven if one upstream is measurably slower than another. A profile fixes the four
fields that set a stream's speed and nothing else:

======= ================== ================= ============ ===========
profile prefill overhead   prefill rate      ITL (alone)  ITL growth
======= ================== ================= ============ ===========
fast    0.03 s             20 000 tokens/s   0.01 s       0.005
slow    0.5 s              2 500 tokens/s    0.05 s       0.02
======= ================== ================= ============ ===========

So with a free slot and an uncached prompt of P tokens, TTFT is 30 ms + P / 20 000
on ``fast`` (a 1 000-token prompt: 80 ms) and 500 ms + P / 2 500 on ``slow`` (900 ms),
and a lone stream decodes at 100 and 20 tokens/s. Both stay under the shipped 2 s
TTFT alert for ordinary prompts, so the slow upstream shows on the comparison
panels without paging anyone; fault injection, slots, models and the seed stay
whatever the base configuration says.

A profile is applied on top of a base :class:`SimConfig` (the defaults, the
demo's, or the command line's): :func:`profile_config` replaces the four fields,
and on the command line a speed flag given explicitly (``--itl 0.03``) wins over
the profile. The figures live here only; docs/simulator.md and docs/getting-started.md
quote them, and tests/test_simulator_profiles.py checks the schedule against them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from proxy.simulator.model import ConfigError, SimConfig

if TYPE_CHECKING:
    from fastapi import FastAPI

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
