"""`sprinter demo` tells the truth plainly: quality columns a user can trust, a footnote where a lossless
mode agrees below 1 in bf16, and exact identity in float32 (real cloud and edge processes, tiny pair)."""

from __future__ import annotations

import argparse
import json
import logging

import pytest

from common.spec.modes import mode_of
from sim import demo


def _demo_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.register(parser.add_subparsers())
    return parser.parse_args(["demo", *argv])


@pytest.mark.slow
def test_float32_demo_shows_lossless_modes_identical_and_the_nll_column(tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO)
    args = _demo_args("--target", "tiny-random", "--draft", "tiny-random-draft", "--dtype", "float32",
                      "--prompts", "1", "--max-tokens", "16", "--out", str(tmp_path))
    assert args.run(args) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("| mode |"))
    assert "agreement with target" in header and "target NLL/token" in header
    rows = {r["mode"]: r for r in json.loads((tmp_path / "demo.json").read_text())["rows"]}
    for mode in ("target", "cloud-sd", "sd-block", "sprinter-exact", "auto"):  # auto: whichever it chose
        assert rows[mode]["lossless"] and rows[mode]["degraded"] == 0
        assert rows[mode]["agreement_with_target"] == 1.0, mode
        assert f"| {mode} | resident (float32) | yes |" in out
        assert "| 1.000 |" in next(line for line in out.splitlines() if line.startswith(f"| {mode} |"))
        # identical tokens, identical score
        assert rows[mode]["target_nll_per_token"] == pytest.approx(rows["target"]["target_nll_per_token"], abs=1e-4)
    assert "* " not in out  # no footnote: nothing to explain
    assert "no llama.cpp baselines" in out  # tiny random models are no GGUF: said, not hidden
    assert not [r for r in caplog.records if r.getMessage().startswith("HTTP Request")]  # no per-request noise


def _row(mode: str, agreement: float) -> demo.DemoRow:
    return demo.DemoRow(mode, mode_of(mode).lossless, 10.0, 0.3, agreement, 1.5, 64, engine="resident (bfloat16)")


def test_bf16_table_footnotes_a_lossless_mode_below_one():
    rows = [_row("target", 1.0), _row("sd-block", 0.707), _row("sprinter", 0.5), _row("sprinter-exact", 1.0)]
    table = demo.format_table(rows, "bfloat16")
    assert "| sd-block | resident (bfloat16) | yes | 10.00 | 0.300 | 0.707* | 1.500 |" in table
    assert "| sprinter-exact | resident (bfloat16) | yes | 10.00 | 0.300 | 1.000 | 1.500 |" in table  # no mark where nothing to explain
    footnote = next(line for line in table.splitlines() if line.startswith("* "))
    assert "sd-block" in footnote and "sprinter-exact" not in footnote
    assert "bfloat16" in footnote and "DTYPE=float32" in footnote and "--dtype float32" in footnote
    assert "approximate by design" in table  # sprinter's own agreement below 1 is explained too


def test_float32_table_calls_a_lossless_mode_below_one_a_bug():
    table = demo.format_table([_row("target", 1.0), _row("sprinter-exact", 0.9)], "float32")
    footnote = next(line for line in table.splitlines() if line.startswith("* "))
    assert "bug" in footnote and "bfloat16" not in footnote


def test_demo_refuses_a_prompt_count_it_does_not_have():
    with pytest.raises(SystemExit):
        _demo_args("--prompts", str(len(demo.PROMPTS) + 1))
