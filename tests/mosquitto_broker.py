"""A real Mosquitto broker for tests (sim/broker.py), or a skip where it is missing (a failure in CI)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sim.broker import MosquittoBroker, mosquitto_binary
from sim.processes import free_port

__all__ = ["MosquittoBroker", "broker", "free_port"]


def broker(directory: Path, **options: object) -> MosquittoBroker:
    try:
        mosquitto_binary()
    except FileNotFoundError as err:
        if os.environ.get("SPRINTER_REQUIRE_PRESETS") == "1":
            pytest.fail(str(err))
        pytest.skip(str(err))
    return MosquittoBroker(directory, **options)
