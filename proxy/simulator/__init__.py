"""Simulated LLM upstream: the demo's, the compose file's and the tests' LLM.

It speaks OpenAI chat completions, completions and Responses, and Anthropic Messages.
``model`` holds the latency model (plain code, time passed in); ``engine`` runs one
request's life on the event loop; ``chat``, ``responses`` and ``messages`` turn its
steps into each API's bytes; ``app`` serves them over HTTP with FastAPI and
sse-starlette; ``profiles`` names speed profiles (``fast``, ``slow``) for running it
as several upstreams of different speeds; ``cli`` is the ``simulate`` sub-command.
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
