"""The options' names and help: StreamKL's named like the baselines' (the earlier names warn), plain-text
help for every option of `run` and `study`, and the defaults of the main job."""

from __future__ import annotations

import argparse

import pytest

from cl_streamkl.experiment import cli
from cl_streamkl.experiment.config import ExperimentConfig
from cl_streamkl.experiment.option_parser import OptionParser
from cl_streamkl.experiment.study.command import PROG, add_arguments


def _study_parser() -> argparse.ArgumentParser:
    parser = OptionParser(prog=PROG)
    add_arguments(parser)
    return parser


@pytest.mark.parametrize(("new", "old", "field", "text", "value"), [
    ("--streamkl-alpha", "--alpha", "alpha", "3", 3.0),
    ("--streamkl-temperature", "--temperature", "temperature", "0.5", 0.5),
    ("--streamkl-layers", "--layers", "layers", "0,2", [0, 2]),
])
def test_streamkl_options_and_their_deprecated_names(capsys, new, old, field, text, value):
    parser = cli.build_parser()
    assert getattr(cli._config_from_args(parser.parse_args(["run", new, text])), field) == value
    assert capsys.readouterr().err == ""
    assert getattr(cli._config_from_args(parser.parse_args(["run", old, text])), field) == value
    assert capsys.readouterr().err == f"cl-streamkl: warning: {old} is deprecated and will be removed; use {new}\n"
    assert old not in parser.format_help() and new in cli._parsers(None)[1].format_help()


def test_configuration_files_take_either_name():
    assert ExperimentConfig.from_dict({"streamkl_alpha": 2.0, "streamkl-layers": 1}).alpha == 2.0
    assert ExperimentConfig.from_dict({"alpha": 2.0}).alpha == 2.0
    with pytest.raises(ValueError, match="given twice"):
        ExperimentConfig.from_dict({"alpha": 2.0, "streamkl_alpha": 3.0})


@pytest.mark.parametrize("parser", [cli._parsers(None)[1], _study_parser()], ids=["run", "study"])
def test_every_option_has_plain_help(parser):
    text = parser.format_help()
    assert "``" not in text and ":class:" not in text and ":func:" not in text
    missing = [action.option_strings or action.dest for action in parser._actions
               if not action.help and action.help is not argparse.SUPPRESS]
    assert missing == []


def test_study_help_names_every_plan_format():
    assert "YAML, TOML or JSON" in _study_parser().format_help()


def test_the_main_job_is_the_task_scenario_over_three_seeds():
    config = ExperimentConfig().resolved()
    assert (config.scenario, config.experiences, config.first_experience_classes) == ("task", 3, 6)
    assert (config.epochs, config.seeds, config.alpha, config.pad_variant) == (5, [0, 1, 2], 100.0, "asymmetric")
    # The digits stream's default applies where neither count is given, and never in the domain scenario.
    assert ExperimentConfig(experiences=5).resolved().first_experience_classes is None
    assert ExperimentConfig(scenario="domain").resolved().first_experience_classes is None
    assert ExperimentConfig(dataset="mnist5k").resolved().experiences is None
