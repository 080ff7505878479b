"""Simulated LLM upstream: the demo's, the compose file's and the tests' LLM.

Design: ``docs/design/simulator.md``.
"""

from __future__ import annotations

from proxy.simulator.model import ConfigError, LatencyModel, SimConfig
from proxy.simulator.profiles import PROFILES, SpeedProfile, create_profile_app, profile_config

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


def __getattr__(name: str) -> object:
    # The web stack is imported only when the app is asked for (keeps --help fast).
    if name == "create_simulator_app":
        from proxy.simulator.app import create_simulator_app

        return create_simulator_app
    raise AttributeError(name)
