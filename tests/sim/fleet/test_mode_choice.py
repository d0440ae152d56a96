"""`sprinter fleet choose` (sim/fleet/mode_choice.py): `--mode auto`'s choice on clouds not run here, by the cost
model the edge decides with, beside the fleet simulator's speeds of each mode on the same costs."""

from __future__ import annotations

import json

from common.cli import main
from sim.fleet.mode_choice import CLOUDS, choose


def test_the_simulator_agrees_with_the_cost_models_choice_on_every_cloud():
    rows = choose(tuple(CLOUDS), (0.0, 50.0, 100.0, 200.0), 128)
    assert len(rows) == 4 * len(CLOUDS)
    assert all(row["agrees"] and row["auto_over_best"] >= 0.97 for row in rows)


def test_where_a_verify_costs_a_step_it_speculates_and_where_it_costs_four_it_does_not():
    resident, llama = choose(("this-cpu-resident",), (50.0,), 128), choose(("this-cpu",), (50.0,), 128)
    assert resident[0]["choice"] == "sprinter-exact" and llama[0]["choice"] == "target"


def test_the_command_writes_its_table_and_results(tmp_path, capsys):
    assert main(["fleet", "choose", "--clouds", "h100", "--rtt-ms", "0", "--out", str(tmp_path)]) == 0
    assert "| h100 | 0 |" in capsys.readouterr().out and "host-bound" in (tmp_path / "table.md").read_text()
    assert json.loads((tmp_path / "results.json").read_text())["rows"][0]["cloud"] == "h100"


def test_the_commands_cloud_names_are_the_projections_clouds():
    from sim.fleet.choose_command import CLOUD_NAMES

    assert set(CLOUD_NAMES) == set(CLOUDS)
