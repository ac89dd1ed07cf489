"""Does the StreamKL penalty hold attention during an experience? Steps from a study checkpoint, per backend.

Why: at 4097 tokens the efficacy study's per-step StreamKL penalty (alpha 100) rose from 0 to
100-300 within an experience's first 50 steps and stayed there in four of five seeds, while at
1025 tokens it stayed at 0.05-0.4. Either the penalty's gradient was wrong at that length or the
penalty could not hold the attention against the new task's loss. On the H200 this replay found
the first: before commit 8234a5c the first backward launch of each tuning key (the autotuner's
path, which the grouped kernels take past 2048 tokens) read student log-sum-exps the autotuner
had zeroed (the gradient's relative error at the first step: 9e6); since, the gradient agrees
with float64 to 3e-3 and the penalty falls. This replays the study's next experience from one
of its checkpoints (the model after the previous experiences is the teacher,
as in the study): the same model, data, batch size, Adam learning rate and bf16 autocast,
cross-entropy plus ``alpha`` × StreamKL, once per ``--backends`` entry (``triton``: the study's
kernels; ``torch``: the PyTorch streaming backend, an independent implementation) and, with
``--penalty-only``, once more without the cross-entropy (the penalty must then fall). Every
``--check-every`` steps the penalty and its gradient w.r.t. every block's student Q/K are checked
against the float64 reference on the same captured tensors.

Usage (from the repository root; the checkpoint's dataset is generated or read from the cache):
    python benchmarks/penalty_descent.py --checkpoint RUN/checkpoints/lwf+streamkl-seed200.pt \\
        --device cuda --steps 200 --json benchmarks/results/penalty-descent.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from cl_streamkl.experiment.study.plan import tokens as token_count
from _harness.measure import relative_error
from _harness.report import (add_json_flag, describe_environment, environment_line, run_settings, table_header,
                             write_json)
from cl_streamkl import attention_kl_reference
from cl_streamkl.experiment.config import ExperimentConfig
from cl_streamkl.experiment.preflight import build_run_model, build_run_stream, check_experiment
from cl_streamkl.experiment.template import autocast
from cl_streamkl.capture import TeacherQK
from cl_streamkl.strategies import AttentionDistiller

BACKENDS = ("triton", "torch")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True,
                        help="a run checkpoint of the study (cl_streamkl.run-checkpoint), after >= 1 experience")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=200, help="training steps per backend (default 200)")
    parser.add_argument("--batch-size", type=int, help="default: the checkpoint's")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--penalty-only", action="store_true",
                        help="also run each backend on the penalty alone (no cross-entropy)")
    parser.add_argument("--compile-model", action="store_true", help="the student through compile_model, as the study")
    parser.add_argument("--check-every", type=int, default=50, help="float64 check every N steps (0: none)")
    parser.add_argument("--commit", help="commit to record")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.check_every < 0:
        parser.error("--check-every must be >= 0")
    if not args.checkpoint.is_file():
        parser.error(f"--checkpoint {args.checkpoint} is not a file")
    return args


def load_checkpoint(path: Path, device: str, compile_model: bool, batch_size: int | None) -> dict[str, Any]:
    """The checkpoint's configuration, stream, weights and the experience that comes next."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 - any unreadable file gets the same one line
        raise SystemExit(f"penalty_descent.py: --checkpoint {path} cannot be read: {err}") from None
    if not isinstance(state, dict) or str(state.get("format", "")).split("/")[0] != "cl_streamkl.run-checkpoint":
        raise SystemExit(f"penalty_descent.py: --checkpoint {path} is not a run checkpoint")
    fields = {**json.loads(state["config"]), "device": device, "compile_model": compile_model,
              "compile_teacher": False}
    if batch_size is not None:
        fields["batch_size"] = batch_size
    config = ExperimentConfig.from_dict(fields).resolved()
    stream = build_run_stream(config, check_experiment(config), int(state["seed"]))
    experience = int(state["experiences_done"])
    if not 1 <= experience < len(stream.train):
        raise SystemExit(f"penalty_descent.py: --checkpoint {path} has {experience} experiences done; "
                         f"1 to {len(stream.train) - 1} leave one to replay")
    return {"config": config, "stream": stream, "weights": state["model"], "experience": experience,
            "seed": int(state["seed"]), "name": f"{state['strategy']} seed {state['seed']}"}


def fresh_model(run: dict[str, Any]) -> torch.nn.Module:
    config = run["config"]
    model = build_run_model(config, run["stream"], torch.device(config.device))
    model.load_state_dict(run["weights"])
    return model.train()


def float64_check(distiller: AttentionDistiller, capture: Any, teacher: Any) -> dict[str, float]:
    """The penalty and its gradient w.r.t. the captured student Q/K against the float64 reference.

    Block by block: at 4097 tokens and batch 32 one block's materialised float64 maps take
    tens of GB, so each block's graph is freed before the next is built.
    """
    qk = [(q.detach().requires_grad_(), k.detach().requires_grad_()) for q, k in capture.qk]
    inputs = [t for pair in qk for t in pair]
    value = distiller.penalty(None, TeacherQK(qk=qk, scales=capture.scales), teacher=teacher)
    grads = torch.autograd.grad(value, inputs)
    weight = distiller.alpha / len(qk)
    reference, reference_grads = 0.0, []
    for (q, k), (q_t, k_t), scale, teacher_scale in zip(qk, teacher.qk, capture.scales, teacher.scales):
        block = weight * attention_kl_reference(q, k, q_t, k_t, scale=scale, teacher_scale=teacher_scale,
                                                temperature=distiller.temperature)
        reference += float(block.detach())
        reference_grads += torch.autograd.grad(block, (q, k))
        del block
    value = float(value.detach())
    return {"value": value, "reference": reference,
            "value_rel_err": abs(value - reference) / max(abs(reference), 1e-30),
            "grad_rel_err": max(relative_error(g, r) for g, r in zip(grads, reference_grads))}


def replay(run: dict[str, Any], backend: str, steps: int, with_loss: bool, check_every: int) -> dict[str, Any]:
    """Train the next experience for ``steps`` steps; the penalty, loss and checks along the way."""
    config, device = run["config"], torch.device(run["config"].device)
    torch.manual_seed(run["seed"])
    student = fresh_model(run)
    distiller = AttentionDistiller(alpha=config.alpha, layers=config.layers, temperature=config.temperature,
                                   backend=backend)
    distiller.update_teacher(student)
    optimizer = torch.optim.Adam(student.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    loader = torch.utils.data.DataLoader(run["stream"].train[run["experience"]], batch_size=config.batch_size,
                                         shuffle=True, drop_last=True)
    penalties, losses, checks, step = [], [], [], 0
    while step < steps:
        for images, labels, tasks in loader:
            images, labels, task = images.to(device), labels.to(device), int(tasks[0])
            with autocast(device, config.amp):
                teacher = distiller.teacher_qk(images)
                with distiller.student_capture(student) as capture:
                    logits = student(images, task) if config.scenario == "task" else student(images)
                penalty = distiller.penalty(images, capture, teacher=teacher)
                loss = F.cross_entropy(logits.float(), labels)
            if check_every and step % check_every == 0:
                checks.append({"step": step, **float64_check(distiller, capture, teacher)})
            optimizer.zero_grad(set_to_none=True)
            ((loss + penalty) if with_loss else penalty).backward()
            optimizer.step()
            penalties.append(float(penalty.detach()))
            losses.append(float(loss.detach()))
            step += 1
            if step == steps:
                break
    return {"backend": backend, "cross_entropy": with_loss, "penalties": penalties, "losses": losses,
            "checks": checks}


COLUMNS = [
    {"name": "backend"}, {"name": "loss"}, {"name": "batch", "align": "right", "format": "d"},
    {"name": "steps", "align": "right", "format": "d"},
    {"name": "penalty at start", "align": "right", "format": ".3g"},
    {"name": "after 1 step", "align": "right", "format": ".3g"},
    {"name": "max", "align": "right", "format": ".3g"},
    {"name": "mean of last tenth", "align": "right", "format": ".3g"},
    {"name": "float64 checks", "align": "right", "format": "d"},
    {"name": "worst value rel. err.", "align": "right", "format": ".1e"},
    {"name": "worst gradient rel. err.", "align": "right", "format": ".1e"},
]


def table_row(result: dict[str, Any], batch: int) -> list[Any]:
    """One run as a row of :data:`COLUMNS`."""
    penalties, checks = result["penalties"], result["checks"]
    tail = penalties[-max(1, len(penalties) // 10):]
    worst = (lambda key: max(check[key] for check in checks)) if checks else (lambda key: None)
    return [result["backend"], "cross-entropy + penalty" if result["cross_entropy"] else "penalty alone", batch,
            len(penalties), penalties[0], penalties[min(1, len(penalties) - 1)], max(penalties),
            sum(tail) / len(tail), len(checks), worst("value_rel_err"), worst("grad_rel_err")]


def summary_line(row: list[Any]) -> str:
    return " | ".join(f"{column['name']} {value if value is None else format(value, column.get('format', ''))}"
                      for column, value in zip(COLUMNS, row))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    environment = describe_environment(torch.device(args.device), args.commit)
    print("# " + environment_line(environment), flush=True)
    run = load_checkpoint(args.checkpoint, args.device, args.compile_model, args.batch_size)
    tokens = token_count({"image_size": run["config"].image_size, "patch_size": run["config"].patch_size})
    print(f"# {args.checkpoint.name}: experience {run['experience'] + 1} of {len(run['stream'].train)}, "
          f"{tokens} tokens, alpha {run['config'].alpha}", flush=True)
    results, rows = [], []
    for with_loss in (True, False) if args.penalty_only else (True,):
        for backend in args.backends:
            results.append(replay(run, backend, args.steps, with_loss, args.check_every))
            rows.append(table_row(results[-1], run["config"].batch_size))
            print(summary_line(rows[-1]), flush=True)
    if args.json is not None:
        title = (f"StreamKL penalty replaying experience {run['experience'] + 1} of a study checkpoint "
                 f"({run['name']}, {tokens} tokens, alpha {run['config'].alpha:g}), per backend")
        write_json(args.json, {"title": title, **table_header(environment), "settings": run_settings(args),
                               "columns": COLUMNS, "rows": rows, "runs": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
