"""What the study tests share: a tiny plan, the project's short plan, plan files and one-line errors."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml

from cl_streamkl.experiment.study.plan import check_plan, load_plan

ROOT = Path(__file__).resolve().parents[3]
STUDIES = ROOT / "benchmarks" / "studies"
RESULTS = ROOT / "benchmarks" / "results"
# A 1-block, 16-wide ViT on 16 px digits with 8 px patches (5 tokens): a unit takes about a second.
TINY = {"dataset": "digits", "image_size": 16, "patch_size": 8, "epochs": 1, "batch_size": 64, "amp": "none",
        "model_kwargs": {"depth": 1, "embed_dim": 16, "num_heads": 2}}
ERROR = "cl-streamkl study: error: "


def tiny_plan(**changes: Any) -> dict[str, Any]:
    """A small plan as a user writes it (no defaults filled in): one class scenario, two tuned
    families with two settings each, a replay arm; ``changes`` replace top-level keys."""
    plan = {
        "regime": "tiny", "settings": copy.deepcopy(TINY), "val_seeds": [7, 8], "test_seeds": [0, 1],
        "arms": {"": {}, "mem20pc": {"mem_per_class": 20}},
        "scenarios": {"class": {
            "options": {"experiences": 3, "first_experience_classes": 6},
            "tuning": {"lwf": {"strategy": "lwf", "arm": "", "grid": [{"lwf_alpha": 1.0}, {"lwf_alpha": 4.0}]},
                       "replay": {"strategy": "replay", "arm": "mem20pc",
                                  "grid": [{"mem_batch_size": 8}, {"mem_batch_size": 16}]}},
            "test": {"": ["naive", "lwf", "lwf+streamkl"], "mem20pc": ["replay", "replay+streamkl"]}}},
    }
    plan.update(changes)
    return plan


def short_plan(tiny: bool = False, per_method: int | None = None, val_seeds: list[int] | None = None,
               test_seeds: list[int] | None = None) -> dict[str, Any]:
    """The project's short study (benchmarks/studies/efficacy-short.yaml), checked; ``tiny``: on
    :data:`TINY`'s settings, ``per_method``: the first settings of every grid only."""
    plan = load_plan(STUDIES / "efficacy-short.yaml")
    if tiny:
        plan["settings"] = copy.deepcopy(TINY)
    if per_method is not None:
        for part in plan["scenarios"].values():
            for family in part["tuning"].values():
                family["grid"] = family["grid"][:per_method]
    plan["val_seeds"] = val_seeds or plan["val_seeds"]
    plan["test_seeds"] = test_seeds or plan["test_seeds"]
    return check_plan(plan)


def write_plan(path: Path, plan: dict[str, Any]) -> Path:
    """``plan`` as a plan file (YAML, TOML by suffix, else JSON); its path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix in (".yaml", ".yml"):
        path.write_text(yaml.safe_dump(plan, sort_keys=False))
    else:
        path.write_text(json.dumps(plan))
    return path


def one_line_error(capsys: Any) -> str:
    """The captured stderr, checked to be one ``cl-streamkl study: error:`` line; that line."""
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(ERROR) and "Traceback" not in err, err
    return lines[0]


def files_under(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes (what a refused start must leave as it was)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
