"""Settings: one declaration per field and flag, configuration files (JSON, YAML), refused values."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest
from cli_helpers import one_line_error

from cl_streamkl.experiment import cli
from cl_streamkl.experiment.config import ExperimentConfig
from cl_streamkl.experiment.config_file import read_config_file
from cl_streamkl.experiment.option_aliases import DEPRECATED_OPTIONS, flag_name

CONTROL_OPTIONS = {"--help", "--config", "--resume", "--log", "--no-progress", "--dist-timeout"}


def test_every_field_is_its_flag_and_every_setting_flag_a_field():
    run = cli._parsers(None)[1]
    options = {o: a for a in run._actions for o in a.option_strings if o.startswith("--")}
    fields = {flag_name(f.name): f.name for f in dataclasses.fields(ExperimentConfig)}
    assert {o: options[o].dest for o in fields} == fields
    assert {o: options[o].dest for o in DEPRECATED_OPTIONS} == DEPRECATED_OPTIONS
    assert set(options) - set(fields) - set(DEPRECATED_OPTIONS) == CONTROL_OPTIONS


def _sample(name: str, hint) -> tuple[object, list[str]]:
    """A value of a field's type that is not its default, and the option's words that give it."""
    flag = next(f.metadata["flag"] for f in dataclasses.fields(ExperimentConfig) if f.name == name)
    if flag.choices is not None:
        choice = next(c for c in reversed(flag.choices) if c != getattr(ExperimentConfig(), name))
        return choice, [str(choice)]
    if name == "layers":
        return [0, -1], ["0,-1"]
    if name == "model_kwargs":
        return {"depth": 2}, ["depth=2"]
    base = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
    if typing.get_origin(hint) is list:
        return ([3, 4], ["3", "4"]) if typing.get_args(hint)[0] is int else (["lwf", "ewc"], ["lwf", "ewc"])
    return {bool: (True, []), int: (3, ["3"]), float: (0.25, ["0.25"]), str: ("x", ["x"])}[base]


def test_every_flag_reaches_its_field():
    hints = typing.get_type_hints(ExperimentConfig)
    samples = {f.name: _sample(f.name, hints[f.name]) for f in dataclasses.fields(ExperimentConfig)}
    argv = ["run"]
    for name, (value, words) in samples.items():
        assert value != getattr(ExperimentConfig(), name), name
        argv += [flag_name(name), *words]
    config = cli._config_from_args(cli.build_parser().parse_args(argv))
    assert config.to_dict() == {name: value for name, (value, _) in samples.items()}


@pytest.mark.parametrize("suffix, text", [
    (".yaml", "experiences: 2\nbatch-size: 8\nlr: 1e-4\nseeds: [1, 2]\nmodel_kwargs: {depth: 1}\n"),
    (".json", '{"experiences": 2, "batch_size": 8, "lr": 1e-4, "seeds": [1, 2], "model-kwargs": {"depth": 1}}'),
])
def test_configuration_files_take_the_flags_names(tmp_path, suffix, text):
    path = tmp_path / f"settings{suffix}"
    path.write_text(text)
    config = read_config_file(path)
    assert (config.experiences, config.batch_size, config.lr, config.seeds) == (2, 8, 1e-4, [1, 2])
    assert config.model_kwargs == {"depth": 1}


def test_old_keys_are_read_with_a_warning(tmp_path, capsys):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"n_experiences": 2, "epochs": 1}))
    with pytest.warns(FutureWarning, match="'n_experiences' is read as 'experiences'"):
        assert read_config_file(path).experiences == 2
    # the command line says it in one line
    assert cli.main(["run", "--config", str(path), "--lr", "nan"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("cl-streamkl: warning: ") and "n_experiences" in err[0] and len(err) == 2


@pytest.mark.parametrize("settings, message", [
    ({"lrr": 0.1}, "unknown key 'lrr' (did you mean 'lr'?)"),
    ({"n-experience": 2}, "unknown key 'n-experience' (did you mean 'experiences'"),
    ({"lr": None}, "lr must be a number; got None"),
    ({"seeds": 5}, "seeds must be a list of integers; got 5"),
    ({"seeds": ["a"]}, "seeds must be a list of integers; got ['a']"),
    ({"model_kwargs": [1, 2]}, "model_kwargs must be a mapping of names to values or null; got [1, 2]"),
    ({"mem_size": 1.5}, "mem_size must be an integer; got 1.5"),
    ({"download": "yes"}, "download must be true or false; got 'yes'"),
    ({"out": None, "epochs": True}, "epochs must be an integer; got True"),
    ({"dataset": "cifar"}, "got 'cifar' (did you mean 'cifar10' or 'cifar100'?)"),
    # a field whose option has another name is named both ways, whichever key gave it
    ({"streamkl_alpha": -1}, "settings.json: alpha (--streamkl-alpha) must be >= 0; got -1\n"),
    ({"layers": 1.5}, "layers (--streamkl-layers) must be a string or an integer or a list of integers; got 1.5"),
    ({"streamkl_layers": 9, "strategies": ["streamkl"]}, "layers (--streamkl-layers): layers=9 selects the last n"),
])
def test_bad_configuration_files_are_one_line_before_anything_is_written(tmp_path, capsys, settings, message):
    path = tmp_path / "settings.json"
    path.write_text(json.dumps(settings))
    out = tmp_path / "out"
    assert cli.main(["run", "--config", str(path), "--out", str(out)]) == 2
    err = one_line_error(capsys)
    assert message in err
    assert not out.exists()


def test_a_files_value_out_of_its_range_is_refused_naming_the_file_whatever_the_flags(tmp_path, capsys):
    """The file is what needs mending, even when a flag gives the run another value."""
    path = tmp_path / "settings.yaml"
    path.write_text("epochs: 1\nlr: 0\n")
    out = tmp_path / "out"
    for flags in ([], ["--lr", "0.1"]):
        assert cli.main(["run", "--config", str(path), *flags, "--out", str(out)]) == 2
        assert one_line_error(capsys) == f"cl-streamkl: error: {path}: lr must be > 0; got 0\n"
    assert not out.exists()


def _billion_laughs() -> str:
    """A 1 kB YAML file whose nested aliases expand to 10**9 strings inside model_kwargs."""
    lines = ["model_kwargs:", '  l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 9)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("suffix, text, message", [
    (".yaml", "batch_size: 8\nepochs: 1\nbatch_size: 16\n", "key 'batch_size' is given twice (line 3)"),
    (".yml", "model_kwargs:\n  depth: 1\n  depth: 2\n", "key 'depth' is given twice (line 3)"),
    (".json", '{"lr": 0.1, "epochs": 1, "lr": 0.2}', "key 'lr' is given twice"),
    (".json", '{"model_kwargs": {"depth": 1, "depth": 2}}', "key 'depth' is given twice"),
    (".yaml", _billion_laughs(), "aliases (*l0, line 3) are not read in configuration files"),
    (".yaml", "seeds: &s [1, 2]\nmodel_kwargs: {depth: *s}\n", "aliases (*s, line 2)"),
    (".json", "[" * 100_000 + "]" * 100_000, "values nested too deeply for a configuration"),
    (".yaml", "[" * 100_000 + "]" * 100_000, "values nested too deeply for a configuration"),
    (".json", b"\xff\xfe{}", "not UTF-8 text"),
])
def test_configuration_files_are_read_strictly(tmp_path, capsys, suffix, text, message):
    path = tmp_path / f"settings{suffix}"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    out = tmp_path / "out"
    start = time.perf_counter()
    assert cli.main(["run", "--config", str(path), "--out", str(out)]) == 2
    assert time.perf_counter() - start < 10  # refused, not expanded
    assert f"{path}: {message}" in one_line_error(capsys)
    assert not out.exists()


@pytest.mark.parametrize("args, message", [
    (["--lr", "nan"], "lr must be a finite number; got nan"),
    (["--lr", "inf"], "lr must be a finite number; got inf"),
    (["--lr", "0"], "lr must be > 0; got 0.0"),
    (["--weight-decay", "-1"], "weight_decay must be >= 0; got -1.0"),
    (["--seeds", "0", str(2**64)], f"seeds must be an integer from 0 to 2**64 - 1; got {2**64}"),
    (["--seeds", "-1"], "seeds must be an integer from 0 to 2**64 - 1; got -1"),
    (["--split-seed", str(2**70)], "split_seed must be an integer from 0 to 2**64 - 1"),
    (["--lwf-alpha", "inf"], "lwf_alpha must be a finite number; got inf"),
    (["--lwf-temperature", "nan"], "lwf_temperature must be a finite number; got nan"),
    (["--ewc-lambda", "nan"], "ewc_lambda must be a finite number; got nan"),
    (["--rotation-step", "nan"], "rotation_step must be a finite number; got nan"),
    (["--streamkl-alpha=-inf"], "alpha (--streamkl-alpha) must be a finite number; got -inf"),
    (["--streamkl-temperature", "0"], "temperature (--streamkl-temperature) must be > 0; got 0.0"),
    (["--mem-size", "-1"], "mem_size must be >= 0; got -1"),
    (["--val-fraction", "1"], "val_fraction must be below 1"),
    (["--image-size", "100000"], "image_size 100000 is above the largest supported, 4096 px"),
    (["--image-size", "4096", "--patch-size", "8"], "262,144 tokens per image, above the largest supported, 65,536"),
    (["--epochs", "0"], "epochs must be > 0; got 0"),
    (["--batch-size", "1" + "0" * 26], f"batch_size must be at most 2**31 - 1 (2,147,483,647); got 1{'0' * 26}"),
    (["--eval-batch-size", str(2**31)], "eval_batch_size must be at most 2**31 - 1"),
    (["--mem-size", str(2**63)], "mem_size must be at most 2**31 - 1"),
    (["--epochs", str(2**40)], "epochs must be at most 2**31 - 1"),
    (["--experiences", str(2**64)], "experiences must be at most 2**31 - 1"),
    (["--lrr", "0.1"], "unrecognized arguments: --lrr 0.1 (did you mean '--lr'?)"),
    (["--epochs", "x"], "argument --epochs: invalid int value: 'x'"),
    (["--dist-timeout", "nan"], "argument --dist-timeout: must be > 0 and at most 604,800 seconds (a week); got nan"),
    (["--dist-timeout", "-1"], "argument --dist-timeout: must be > 0"),
    (["--dist-timeout", "1e300"], "argument --dist-timeout: must be > 0"),
    (["--dist-timeout", "soon"], "argument --dist-timeout: expected a number of seconds; got 'soon'"),
    (["--strategies", "naive", "lfw"], "unknown strategy component 'lfw' in 'lfw' (did you mean 'lwf'?)"),
])
def test_bad_values_are_one_line_before_anything_is_written(tmp_path, capsys, args, message):
    out = tmp_path / "out"
    assert cli.main(["run", "--out", str(out), *args]) == 2
    assert message in one_line_error(capsys)
    assert not out.exists()


@pytest.mark.parametrize("args, meant", [
    (["--strat", "streamkl"], "--strategies"), (["--streamkl-temp=2"], "--streamkl-temperature"),
    (["--conf", "x.yaml"], "--config")])
def test_a_prefix_of_an_option_is_refused_naming_the_options_it_begins(tmp_path, capsys, args, meant):
    """No abbreviations: a prefix would run as whichever option it begins."""
    out = tmp_path / "out"
    assert cli.main(["run", "--out", str(out), *args]) == 2
    assert f"unrecognized arguments: {' '.join(args)} (did you mean '{meant}'?)" in one_line_error(capsys)
    assert not out.exists()


def test_version_and_top_level_help(capsys):
    from cl_streamkl import __version__

    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--version"])
    assert capsys.readouterr().out.strip() == f"cl-streamkl {__version__}"
    text = cli.build_parser().format_help()
    assert all(word in text for word in ("class-incremental", "task-incremental", "domain-incremental"))
    run_help = cli._parsers(None)[1].format_help()
    assert "--seeds SEED [SEED ...]" in run_help and "from two seeds on (default: 0 1 2)" in " ".join(run_help.split())
    assert "4-block, 64-wide" in run_help and "alpha 1 and temperature 1" in " ".join(run_help.split())


@pytest.mark.parametrize("args, message", [
    (["--strategies", "naive", "lfw"], "unknown strategy component 'lfw'"),
    (["--seeds", "1", "1"], "seeds must be distinct integers"),
    (["--experiences", "4"], "error: experiences must divide the 10 classes; got 4"),
])
def test_argument_errors_answer_before_heavy_imports(args, message):
    code = ("import sys, time\nstart = time.perf_counter()\nfrom cl_streamkl.experiment.cli import main\n"
            f"assert main(['run', *{args!r}]) == 2\n"
            "print(time.perf_counter() - start, sorted(m for m in ('avalanche', 'timm', 'matplotlib') "
            "if m in sys.modules))")
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[2])
    total = time.perf_counter() - start
    assert message in result.stderr, result.stderr
    seconds, modules = result.stdout.split(" ", 1)
    assert modules.strip() == "[]"
    print(f"{args}: reported {float(seconds):.2f} s after the import began, {total:.2f} s for the whole process")


def test_renamed_fields_keep_their_old_names_in_checkpoint_fingerprints():
    # checkpoints written before the rename were stamped with "n_experiences": their folders still resume
    fingerprint = json.loads(ExperimentConfig(experiences=5).resolved().fingerprint_json())
    assert fingerprint["n_experiences"] == 5 and "experiences" not in fingerprint
