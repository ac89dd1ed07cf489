"""The kernels' switches read from the environment: the usual spellings, and one line naming a bad variable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cl_streamkl.kernels import config
from cl_streamkl.kernels.config import KernelOptions, get_kernel_options

SWITCHES = {"CL_STREAMKL_AUTOTUNE": "autotune", "CL_STREAMKL_FAST_LAUNCH": "fast_launch",
            "CL_STREAMKL_GRAD_AFTER_DOT": "grad_after_dot", "CL_STREAMKL_DETERMINISTIC": "deterministic"}


@pytest.mark.parametrize("variable", SWITCHES)
@pytest.mark.parametrize("text, value", [
    ("1", True), ("true", True), ("YES", True), ("On", True), (" true ", True),
    ("0", False), ("false", False), ("no", False), ("OFF", False), ("False", False),
])
def test_switches_take_the_usual_spellings(variable, text, value):
    assert getattr(KernelOptions.from_environment({variable: text}), SWITCHES[variable]) is value


@pytest.mark.parametrize("variable", SWITCHES)
def test_an_empty_switch_is_unset(variable):
    assert KernelOptions.from_environment({variable: ""}) == KernelOptions()


@pytest.mark.parametrize("variable, text", [
    ("CL_STREAMKL_AUTOTUNE", "banana"), ("CL_STREAMKL_AUTOTUNE", "2"), ("CL_STREAMKL_DETERMINISTIC", "enabled"),
    ("CL_STREAMKL_FAST_LAUNCH", "-1"), ("CL_STREAMKL_BACKWARD", "banana"), ("CL_STREAMKL_FORWARD_EXP2", "poly4"),
    ("CL_STREAMKL_BACKWARD_EXP2", "fast"),
])
def test_other_values_are_refused_naming_the_variable(variable, text):
    with pytest.raises(ValueError, match=f"^environment variable {variable} must be .*; got '{text}'$") as caught:
        KernelOptions.from_environment({variable: text})
    assert "\n" not in str(caught.value)


def test_choices_ignore_case():
    chosen = KernelOptions.from_environment({"CL_STREAMKL_BACKWARD": "OnePass",
                                             "CL_STREAMKL_FORWARD_EXP2": "Poly3-Half"})
    assert (chosen.backward, chosen.forward_exp2) == ("onepass", "poly3-half")


def test_the_environment_is_read_on_first_use(monkeypatch):
    monkeypatch.setattr(config, "_current", None)
    monkeypatch.setenv("CL_STREAMKL_AUTOTUNE", "off")
    monkeypatch.setenv("CL_STREAMKL_DETERMINISTIC", "true")
    options = get_kernel_options()
    assert (options.autotune, options.deterministic) == (False, True)
    assert get_kernel_options() is options
    monkeypatch.setattr(config, "_current", None)
    monkeypatch.setenv("CL_STREAMKL_BACKWARD", "banana")
    with pytest.raises(ValueError, match="CL_STREAMKL_BACKWARD"):
        get_kernel_options()


def test_a_bad_variable_does_not_break_importing_the_package():
    code = ("import cl_streamkl\ntry:\n    cl_streamkl.attention_kl(*[__import__('torch').ones(1, 1, 2, 4)] * 4, "
            "backend='triton')\nexcept ValueError as err:\n    print(err)")
    env = {**os.environ, "CL_STREAMKL_BACKWARD": "banana", "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr
    expected = "environment variable CL_STREAMKL_BACKWARD must be one of auto, split, onepass; got 'banana'"
    assert result.stdout.strip() == expected
