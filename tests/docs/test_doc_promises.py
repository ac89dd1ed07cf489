"""What the documents promise: every CLI option in docs/cli.md, README's set-up commands as CI runs
them, CPU wheels, the field's names, license, citation, the CLI's StreamKL weight and its default
run's tokens, every kernel switch in docs/op.md."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import yaml

from cl_streamkl import __version__
from cl_streamkl.experiment.cli import _parsers

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
CLI_DOC = (ROOT / "docs" / "cli.md").read_text()
# The MD5 of the Apache License 2.0 as https://www.apache.org/licenses/LICENSE-2.0.txt serves it.
APACHE_2_MD5 = "3b83ef96387f14655fc854ddc3c6bd57"
TORCH_PIN = "pip install torch==2.14.1 torchvision==0.29.1"


def _section(text: str, title: str) -> str:
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def _pyproject(key: str) -> str:
    return re.search(rf"^{key} = (.+)$", (ROOT / "pyproject.toml").read_text(), re.MULTILINE).group(1)


def _run_options() -> set[str]:
    run = _parsers(None)[1]
    return {option for action in run._actions for option in action.option_strings
            if option.startswith("--")} - {"--help"}


def test_cli_doc_names_every_option():
    missing = sorted(option for option in _run_options() if f"`{option}" not in CLI_DOC)
    assert missing == []


def test_readme_set_up_commands_are_what_ci_runs():
    setup = _section(README, "Set up")
    assert "--index-url https://download.pytorch.org/whl/cpu" in setup
    commands = [line for line in setup.splitlines() if line.startswith(TORCH_PIN)]
    assert commands == [f'{TORCH_PIN} && pip install -e ".[experiment]" && cl-streamkl run',
                        f'{TORCH_PIN} && pip install -e ".[test]" && python -m pytest -q']
    ci = (ROOT / ".ci" / "run").read_text()
    install, test = commands[1].rsplit(" && ", 1)
    assert install in ci and re.search(rf"^{re.escape(test)}$", ci, re.MULTILINE)


def test_the_fields_names_for_accuracies():
    for text in (CLI_DOC, _parsers(None)[1].format_help()):
        assert "Class-IL" in text and "Task-IL" in text and "task-aware" not in text.lower()


def test_license_is_the_apache_2_text_pyproject_names():
    assert hashlib.md5((ROOT / "LICENSE").read_bytes()).hexdigest() == APACHE_2_MD5
    assert _pyproject("license") == '{ text = "Apache-2.0" }'


def test_citation_file_is_valid_and_current():
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert citation["cff-version"] == "1.2.0" and citation["type"] == "software"
    assert citation["version"] == __version__ == _pyproject("version").strip('"')
    assert citation["license"] == "Apache-2.0"
    assert citation["title"].startswith("cl-streamkl") and citation["authors"] and citation["message"]


RUN_TIME = "about two minutes on a 2-core CPU"


def test_readme_installs_from_a_clone_and_stays_an_index():
    assert "pip install cl-streamkl" not in README and "from a clone of this repository" in README
    assert "git clone" not in README  # there is no public address to clone from
    assert len(README.splitlines()) <= 250


def test_the_main_jobs_run_time_is_stated_once_and_the_same_everywhere():
    assert README.count(RUN_TIME) == 1
    assert RUN_TIME in " ".join(_parsers(None)[1].format_help().split())
    assert "README.md#set-up" in CLI_DOC and not re.search(r"\d+ s measured|about a minute", CLI_DOC)


def test_the_clis_streamkl_weight_and_default_tokens_are_quoted_as_they_are():
    import timm

    from cl_streamkl.experiment.config import DEFAULT_MODEL_KWARGS, ExperimentConfig

    config = ExperimentConfig().resolved()
    for name in ("README.md", "docs/cli.md", "docs/plugins.md"):
        quoted = re.findall(r"`(?:--streamkl-alpha|--alpha) (\S+?)[`\s,]", (ROOT / name).read_text())
        assert all(float(value) == config.alpha for value in quoted), (name, quoted)
    model = timm.create_model(config.model, img_size=config.image_size, patch_size=config.patch_size,
                              **DEFAULT_MODEL_KWARGS)
    tokens = model.patch_embed.num_patches + model.num_prefix_tokens
    stated = re.search(rf"upsampled to {config.image_size} px, {config.patch_size} px patches \((\d+)\s+tokens",
                       CLI_DOC)
    assert stated is not None and int(stated.group(1)) == tokens


def test_op_doc_names_every_kernel_switch_and_its_variable():
    import dataclasses

    from cl_streamkl.kernels import config

    switches = _section((ROOT / "docs" / "op.md").read_text(), "Switches")
    fields = [field.name for field in dataclasses.fields(config.KernelOptions)]
    variables = re.findall(r'"(CL_STREAMKL_[A-Z0-9_]+)"', Path(config.__file__).read_text())
    assert len(variables) == len(fields)
    assert [name for name in fields if f"`{name}`" not in switches] == []
    assert [name for name in variables if f"`{name}`" not in switches] == []
