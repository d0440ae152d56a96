"""The baselines' llama-server commands (sim/sweep/baselines.py): what each needs, and no more."""

from __future__ import annotations

import pytest

from common.model.loading import UnknownModel
from sim.sweep.baselines import LLAMA_SERVER, LocalBaselines, llama_server_alone, server_command


@pytest.mark.smollm2
def test_llama_server_alone_needs_no_gguf_of_the_draft(smollm2, tmp_path):
    # a truncated draft has no GGUF: the target's baseline still runs; llama.cpp's own speculation is refused
    alone = llama_server_alone("smollm2-135m", "smollm2-135m:layers=4", tmp_path, frozenset({0}))
    assert alone.names == (LLAMA_SERVER,) and alone.draft is None and alone.cloud_cpus == {0}
    command = server_command(LLAMA_SERVER, alone.target, alone.draft, 8080, alone.cloud_cpus, None)
    assert command[:3] == ["taskset", "-c", "0"] and "-md" not in command
    with pytest.raises(UnknownModel, match="not a GGUF"):
        LocalBaselines(("llama-server-sd",), "smollm2-135m", "smollm2-135m:layers=4", tmp_path, None, None)
