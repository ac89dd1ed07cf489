"""The library's warnings inside a run print as the command's one-line warnings."""

from __future__ import annotations

import warnings

from cli_helpers import run_cli

from cl_streamkl.experiment import library_warnings
from cl_streamkl.experiment.library_warnings import own_warnings_through


def test_own_warnings_go_to_warn_and_others_keep_pythons_form(recwarn):
    lines: list[str] = []
    own_file = str(library_warnings.PACKAGE_DIR / "strategies" / "plugin.py")
    with own_warnings_through(lines.append):
        warnings.warn_explicit("the library's", RuntimeWarning, own_file, 7)
        warnings.warn_explicit("another library's", UserWarning, "/elsewhere/module.py", 3)
        warnings.warn_explicit("compiled code's", UserWarning, "<string>", 1)
    assert lines == ["the library's"]
    assert [(str(w.message), w.filename) for w in recwarn] == [("another library's", "/elsewhere/module.py"),
                                                              ("compiled code's", "<string>")]


def test_without_warn_every_warning_keeps_pythons_form(recwarn):
    before = warnings.showwarning
    with own_warnings_through(None):
        warnings.warn_explicit("the library's", RuntimeWarning, str(library_warnings.PACKAGE_DIR / "x.py"), 7)
    assert warnings.showwarning is before
    assert [str(w.message) for w in recwarn] == ["the library's"]


def test_a_plugin_warning_in_a_run_is_one_cl_streamkl_line(tmp_path, capsys, monkeypatch):
    from cl_streamkl.strategies import plugin

    monkeypatch.setattr(plugin, "QUIET_SHARE", float("inf"))  # every penalty counts as quiet
    rc, _ = run_cli(tmp_path, "w", "--strategies", "streamkl", "--experiences", "2")
    assert rc == 0
    err = capsys.readouterr().err
    assert "cl-streamkl: warning: StreamKLPlugin: alpha × penalty stayed below" in err
    assert "RuntimeWarning" not in err and "plugin.py" not in err
