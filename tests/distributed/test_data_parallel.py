"""Data-parallel `cl-streamkl run`: two gloo processes under torchrun against one process, resume, silence.

Also the smoke path of benchmarks/ddp_throughput.py (its own torchrun launches, 1 and 2 ranks).

Three torchrun launches of two processes on the CPU (each costs seconds of imports), run once
per module: an uninterrupted run, a run stopped (SIGTERM to torchrun) once its second strategy
has checkpointed an experience, and that run resumed. One process with the same global batch
runs in the test process for reference. Every launch waits at most RUN_DEADLINE_S and its
process group fails a rank after GROUP_TIMEOUT_S, so nothing can hang the suite.

A sitecustomize module put first on the processes' path makes every rank other than 0 fail
on any write under the runs' folder (Python audit hooks see every open for writing, mkdir,
rename and remove), which proves that rank 0 alone writes.

The rest runs in this process: torchrun's environment checks, the batch shares and their
loss weights, the refusals, and the StreamKL plugin and LwF through a DDP wrapper in a
process group of one.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from cl_streamkl.experiment import cli
from cl_streamkl.experiment.config import ExperimentConfig
from cl_streamkl.distributed.data_parallel import DataParallel, start_data_parallel
from cl_streamkl.experiment.preflight import check_data_parallel
from cl_streamkl.distributed.sharding import BatchShards, sharded_loader
from cl_streamkl.experiment.strategy_plugins import DataParallelLwFPlugin
from cl_streamkl.strategies import StreamKLPlugin

pytestmark = pytest.mark.distributed

REPOSITORY = Path(__file__).resolve().parents[2]
WORLD_SIZE = 2
GROUP_TIMEOUT_S = 30
# Imports of two processes on two shared cores, a tiny training, and one group timeout to spare.
RUN_DEADLINE_S = 180
# Five experiences of Split-Digits; at a global batch of 64, the second experience's last
# batch holds one image, so rank 1 takes a step on a zero-weight sample there. StreamKL's weight
# is 10, at which the tolerances below were measured (at 100, two processes' penalties differed
# from one process's by 1.8e-6 of 5e-5).
TINY = ["--model-kwargs", "depth=1", "embed_dim=16", "num_heads=2", "--image-size", "8", "--patch-size", "4",
        "--epochs", "1", "--batch-size", "64", "--experiences", "5", "--strategies", "naive", "streamkl",
        "--device", "cpu", "--no-progress", "--scenario", "class", "--seeds", "0", "--streamkl-alpha", "10"]
# Tolerances of two processes against one. Each rank's forward sees half the batch and DDP
# sums the two halves' float32 gradients, so every weight differs from the one-process run
# by rounding: the penalties, means of per-row KLs of nearly equal float32 attention scores
# (about 1e-4, with rounding near 1e-8 per row), differ by about 1e-7 after five
# experiences; an accuracy may move by one test image (about 70 per experience) that sits
# on a tie between two classes.
PENALTY_ATOL, PENALTY_RTOL = 1e-6, 1e-3
ACCURACY_ATOL = 0.02

AUDIT = '''"""Written by tests/distributed/test_data_parallel.py: ranks other than 0 may not write under a watched folder."""
import os
import sys

_WATCHED = os.environ.get("CL_STREAMKL_WATCHED_FOLDER")
_RANK = os.environ.get("RANK")
_WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_CHANGES = {"os.mkdir": (0,), "os.rename": (0, 1), "os.remove": (0,), "os.rmdir": (0,), "os.chmod": (0,),
            "os.truncate": (0,), "shutil.rmtree": (0,), "shutil.copyfile": (1,), "shutil.move": (1,)}


def _watched(path):
    if isinstance(path, int):
        return False
    path = os.path.abspath(os.fsdecode(os.fspath(path)))
    return path == _WATCHED or path.startswith(_WATCHED + os.sep)


def _audit(event, args):
    if event == "open":
        paths = [args[0]] if isinstance(args[2], int) and args[2] & _WRITING else []
    else:
        paths = [args[i] for i in _CHANGES.get(event, ())]
    for path in paths:
        if _watched(path):
            print(f"WRITE BY RANK {_RANK}: {event} {path}", file=sys.stderr, flush=True)
            raise PermissionError(f"rank {_RANK} may not write {path}")


if _WATCHED and _RANK not in (None, "0"):
    sys.addaudithook(_audit)
'''


# ---------------------------------------------------------------- the torchrun runs


def torchrun_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD_SIZE}",
            "-m", "cl_streamkl", "run", *args, "--dist-timeout", str(GROUP_TIMEOUT_S)]


@pytest.fixture(scope="module")
def runs_folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def torchrun_environment(tmp_path_factory, runs_folder) -> dict[str, str]:
    audit = tmp_path_factory.mktemp("audit")
    (audit / "sitecustomize.py").write_text(AUDIT)
    path = os.pathsep.join(filter(None, [str(audit), str(REPOSITORY), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "CL_STREAMKL_WATCHED_FOLDER": str(runs_folder)}


def launch(command: list[str], environment: dict[str, str]) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=REPOSITORY, env=environment, capture_output=True, text=True,
                            timeout=RUN_DEADLINE_S)
    assert "WRITE BY RANK" not in result.stderr, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def one_process(runs_folder) -> dict:
    """The reference: one process, the same global batch (in this process)."""
    out = runs_folder / "one"
    assert cli.main(["run", *TINY, "--out", str(out)]) == 0
    return json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def two_processes(runs_folder, torchrun_environment) -> tuple[subprocess.CompletedProcess, Path]:
    out = runs_folder / "two"
    return launch(torchrun_command(*TINY, "--out", str(out)), torchrun_environment), out


@pytest.fixture(scope="module")
def stopped_and_resumed(runs_folder, torchrun_environment) -> tuple[int, subprocess.CompletedProcess, Path]:
    """A run stopped by SIGTERM to torchrun after streamkl's first checkpoint; then resumed."""
    out = runs_folder / "stopped"
    checkpoint = out / "checkpoints" / "streamkl-seed0.pt"
    process = subprocess.Popen(torchrun_command(*TINY, "--out", str(out)), cwd=REPOSITORY, env=torchrun_environment,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + RUN_DEADLINE_S
        while not checkpoint.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        process.send_signal(signal.SIGTERM)  # torchrun stops its workers, as a scheduler's preemption does
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert checkpoint.exists(), output[-3000:]
    experiences_done = torch.load(checkpoint, weights_only=True)["experiences_done"]
    assert not (out / "results.json").exists() and "WRITE BY RANK" not in output
    resumed = launch(torchrun_command("--resume", str(out), "--no-progress"), torchrun_environment)
    return experiences_done, resumed, out


def test_two_processes_match_one_process_with_the_same_global_batch(one_process, two_processes):
    result, out = two_processes
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    two = json.loads((out / "results.json").read_text())
    assert one_process["environment"]["world_size"] == 1 and two["environment"]["world_size"] == WORLD_SIZE
    assert two["config"] == {**one_process["config"], "out": str(out)}
    for single, parallel in zip(one_process["runs"], two["runs"], strict=True):
        assert single["strategy"] == parallel["strategy"] and single["class_order"] == parallel["class_order"]
        for name in ("accuracy_matrix", "task_il_matrix"):
            expected = torch.tensor(single[name], dtype=torch.float64)
            torch.testing.assert_close(torch.tensor(parallel[name], dtype=torch.float64), expected,
                                       atol=ACCURACY_ATOL, rtol=0)
        assert len(parallel["penalties"]) == len(single["penalties"])
        if single["penalties"]:
            torch.testing.assert_close(torch.tensor(parallel["penalties"]), torch.tensor(single["penalties"]),
                                       atol=PENALTY_ATOL, rtol=PENALTY_RTOL)
            assert max(parallel["penalties"]) > 0


def test_rank_0_alone_prints_and_writes(two_processes):
    result, out = two_processes
    assert result.returncode == 0, result.stderr[-3000:]
    # The audit hook fails rank 1 on any write under the runs' folder (launch() checks its report).
    assert result.stdout.count("cl-streamkl run: digits") == 1
    assert "2 processes" in result.stdout and result.stdout.count("streamkl seed 0  exp 5/5") == 1
    written = sorted(str(path.relative_to(out)) for path in out.rglob("*"))
    assert written == sorted([
        "config.json", "results.json", "results.csv", "summary.csv", "summary.md", ".cl-streamkl.lock",
        "average_accuracy.png",
        "accuracy_matrix_naive.png", "accuracy_matrix_streamkl.png",
        "checkpoints", "checkpoints/naive-seed0.pt", "checkpoints/streamkl-seed0.pt"])


def test_a_stopped_run_resumes_to_the_uninterrupted_results(two_processes, stopped_and_resumed):
    experiences_done, resumed, out = stopped_and_resumed
    assert 1 <= experiences_done < 5, "the run finished before it could be stopped"
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "exp 1/5" not in resumed.stdout  # naive was finished, streamkl continued
    uninterrupted = json.loads((two_processes[1] / "results.json").read_text())["runs"]
    continued = json.loads((out / "results.json").read_text())["runs"]
    # The same processes restore the same states: the same numbers, bit for bit.
    for a, b in zip(uninterrupted, continued, strict=True):
        assert (a["strategy"], a["accuracy_matrix"], a["task_il_matrix"], a["penalties"]) == (
            b["strategy"], b["accuracy_matrix"], b["task_il_matrix"], b["penalties"])
    final = torch.load(out / "checkpoints" / "streamkl-seed0.pt", weights_only=True)
    assert final["finished"] and len(final["rank_rng"]) == WORLD_SIZE
    assert not any(name.startswith("module.") for name in final["model"])


# ---------------------------------------------------------------- torchrun's environment


TORCHRUN = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_without_torchrun_the_run_is_one_process():
    assert start_data_parallel("cpu", environ={"MASTER_ADDR": "somewhere"}) == DataParallel()
    assert start_data_parallel("cpu", environ={**TORCHRUN, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}) == (
        DataParallel())
    assert not dist.is_initialized()


@pytest.mark.parametrize(("environ", "message"), [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT are not: start "
                          "data-parallel runs with torchrun"),
    ({k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"}, "but MASTER_ADDR is not"),
    ({**TORCHRUN, "RANK": "one"}, "RANK='one' is not an integer"),
    ({**TORCHRUN, "RANK": "2"}, "need 0 <= RANK < WORLD_SIZE"),
])
def test_a_half_set_environment_is_refused(environ, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        start_data_parallel("cpu", environ=environ)
    assert not dist.is_initialized()


def test_more_processes_than_gpus_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    # Rank 0 counts its node's processes too, so it stops with rank 1 instead of waiting for it.
    environ = {**TORCHRUN, "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    with pytest.raises(ValueError, match=r"2 processes on this node but 1 GPU\(s\) visible.*--nproc_per_node 1"):
        start_data_parallel("auto", environ=environ)
    assert not dist.is_initialized()


def test_the_cli_reports_a_half_set_environment(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    assert cli.main(["run", *TINY, "--out", str(tmp_path / "run")]) == 2
    assert "cl-streamkl: error: WORLD_SIZE is set but RANK" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- what data parallelism refuses


@pytest.mark.parametrize(("settings", "loggers", "message"), [
    ({}, ["csv"], "--log csv needs a single process"),
    ({"scenario": "task", "strategies": ["naive", "lwf+streamkl"]}, [],
     "strategy 'lwf\\+streamkl' cannot run data-parallel in the task scenario: lwf's penalty"),
    ({"scenario": "task", "strategies": ["ewc"]}, [], "'ewc' cannot run data-parallel in the task scenario"),
    ({"batch_size": 1, "scenario": "class"}, [], "--batch-size 1 is the global batch, split over 2 processes: it must be at least 2"),
])
def test_what_data_parallel_runs_refuse(settings, loggers, message):
    config = ExperimentConfig(**settings).resolved()
    with pytest.raises(ValueError, match=message):
        check_data_parallel(config, loggers, world_size=2)
    check_data_parallel(config, loggers, world_size=1)


def test_ewc_and_lwf_run_data_parallel_outside_the_task_scenario():
    config = ExperimentConfig(scenario="class", strategies=["lwf", "ewc", "replay+streamkl", "wa", "pad", "joint"]
                              ).resolved()
    check_data_parallel(config, [], world_size=8)


# ---------------------------------------------------------------- batch shares


def test_shares_of_a_batch_and_their_loss_weights():
    ranks = [BatchShards(rank, 3) for rank in range(3)]
    batch = list(range(10, 17))  # 7 samples over 3 ranks: 3, 2, 2
    assert [shards.share(batch) for shards in ranks] == [[10, 13, 16], [11, 14], [12, 15]]
    weights = [shards.next_loss_weight() for shards in ranks]
    # DDP averages the 3 ranks' gradients of weight × (mean over the share): each share then
    # counts its samples' part of the batch, as in one process.
    assert [weight / 3 for weight in weights] == pytest.approx([3 / 7, 2 / 7, 2 / 7])
    # Fewer samples than ranks: the rank left without one steps on a sample with weight 0.
    assert [shards.share([5]) for shards in ranks] == [[5], [5], [5]]
    assert [shards.next_loss_weight() for shards in ranks] == [3.0, 0.0, 0.0]
    assert ranks[0].next_loss_weight() == 1.0  # nothing drawn: the loss as it is


def test_one_rank_loads_the_batches_of_a_plain_loader():
    dataset = torch.utils.data.TensorDataset(torch.arange(23))
    torch.manual_seed(4)
    plain = [batch[0].tolist() for batch in torch.utils.data.DataLoader(dataset, batch_size=5, shuffle=True)]
    torch.manual_seed(4)
    shards = BatchShards()
    sharded = [batch[0].tolist() for batch in sharded_loader(dataset, shards, batch_size=5)]
    assert sharded == plain and len(sharded_loader(dataset, shards, batch_size=5)) == 5
    halves = []
    for rank in range(2):  # two processes with the same random numbers
        torch.manual_seed(4)
        halves.append([batch[0].tolist() for batch in sharded_loader(dataset, BatchShards(rank, 2), batch_size=5)])
    for whole, first, second in zip(plain, *halves, strict=True):
        assert first == whole[::2] and second == whole[1::2]


# ---------------------------------------------------------------- plugins through a DDP wrapper


@pytest.fixture
def process_group_of_one(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        yield
    finally:
        dist.destroy_process_group()


def tiny_vit(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=8, num_classes=4,
                             depth=2, embed_dim=32, num_heads=2)


def plugin_iteration(plugin: StreamKLPlugin, strategy: SimpleNamespace, labels: torch.Tensor) -> None:
    """One training iteration of ``strategy.model`` on ``strategy.mb_x`` with the plugin's callbacks
    where Avalanche's template calls them: forward, cross-entropy plus the penalty, backward."""
    plugin.before_forward(strategy)
    logits = strategy.model(strategy.mb_x)
    plugin.after_forward(strategy)
    strategy.loss = F.cross_entropy(logits, labels)
    plugin.before_backward(strategy)
    strategy.loss.backward()


def test_streamkl_plugin_through_a_ddp_wrapper(process_group_of_one):
    model = tiny_vit()
    wrapped = DistributedDataParallel(model)
    plugin = StreamKLPlugin(alpha=1.0, backend="torch")
    strategy = SimpleNamespace(model=wrapped, mb_x=torch.randn(3, 3, 16, 16), loss=torch.zeros(()))
    plugin.before_training(strategy)
    plugin.after_training_exp(strategy)
    # The teacher is a snapshot of the module, never of the wrapper.
    assert type(plugin.teacher) is type(model) and not isinstance(plugin.teacher, DistributedDataParallel)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))

    def step(student: torch.nn.Module) -> tuple[float, list[torch.Tensor]]:
        model.zero_grad()
        strategy.model = student  # the forward runs through the wrapper, which reduces the gradients
        plugin_iteration(plugin, strategy, torch.tensor([0, 1, 2]))
        return plugin.last_penalty, [param.grad.clone() for param in model.parameters()]

    (wrapped_penalty, wrapped_grads), (plain_penalty, plain_grads) = step(wrapped), step(model)
    assert wrapped_penalty == plain_penalty > 0
    for wrapped_grad, plain_grad in zip(wrapped_grads, plain_grads, strict=True):
        torch.testing.assert_close(wrapped_grad, plain_grad)
    # The state names the module's tensors, as a single process's does.
    teacher = plugin.state_dict()["distiller"]["teacher"]
    assert set(teacher) == {name for name, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}


@pytest.mark.usefixtures("traced_not_generated")
def test_a_compiled_model_distils_through_a_ddp_wrapper(process_group_of_one):
    """compile_model under DistributedDataParallel: DDP's gradient hooks fire from the compiled
    backward, and the plugin's teacher is a compiled snapshot of the module, not of the wrapper."""
    import copy

    from cl_streamkl.capture import compile_model
    from cl_streamkl.capture.compiled_model import is_compiled

    torch._dynamo.reset()
    eager = tiny_vit()
    compiled = copy.deepcopy(eager)
    compile_model(compiled)
    wrapped = DistributedDataParallel(compiled)
    x, labels = torch.randn(3, 3, 16, 16), torch.tensor([0, 1, 2])
    perturbation = [0.05 * torch.randn_like(param) for param in eager.parameters()]

    def step(student: torch.nn.Module, module: torch.nn.Module) -> tuple[float, list[torch.Tensor], nn.Module]:
        plugin = StreamKLPlugin(alpha=1.0, backend="torch")
        strategy = SimpleNamespace(model=student, mb_x=x, loss=torch.zeros(()))
        plugin.before_training(strategy)
        plugin.after_training_exp(strategy)  # the teacher: the module before the perturbation
        with torch.no_grad():
            for param, delta in zip(module.parameters(), perturbation, strict=True):
                param.add_(delta)
        module.zero_grad()
        plugin_iteration(plugin, strategy, labels)
        return plugin.last_penalty, [param.grad.clone() for param in module.parameters()], plugin.teacher

    (penalty, grads, teacher), (eager_penalty, eager_grads, _) = step(wrapped, compiled), step(eager, eager)
    assert is_compiled(teacher) and not isinstance(teacher, DistributedDataParallel)
    assert penalty == pytest.approx(eager_penalty, rel=1e-5) and penalty > 0
    for grad, eager_grad in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(grad, eager_grad, rtol=1e-4, atol=1e-6)


def test_lwf_copies_the_module_inside_a_ddp_wrapper(process_group_of_one):
    from avalanche.benchmarks import tensors_benchmark

    benchmark = tensors_benchmark(train_tensors=[[torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 3])]],
                                  test_tensors=[[torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 3])]],
                                  task_labels=[0])
    plugin = DataParallelLwFPlugin()
    model = tiny_vit()
    plugin.after_training_exp(SimpleNamespace(model=DistributedDataParallel(model),
                                              experience=benchmark.train_stream[0]))
    assert type(plugin.lwf.prev_model) is type(model)
    assert plugin.lwf.prev_classes_by_task == {0: {0, 1, 2, 3}}


# ---------------------------------------------------------------- the GPU throughput script


def test_ddp_throughput_script_smoke_run_on_the_cpu(tmp_path, torchrun_environment):
    out = tmp_path / "ddp_throughput.json"
    result = subprocess.run([sys.executable, "benchmarks/ddp_throughput.py", "--smoke", "--json", str(out)],
                            cwd=REPOSITORY, env=torchrun_environment, capture_output=True, text=True,
                            timeout=2 * RUN_DEADLINE_S)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [row["gpus"] for row in report["rows"]] == [1, 2] and report["tokens"] == 5
    assert report["rows"][0]["scaling"] == 1.0 and all(row["images_per_s"] > 0 for row in report["rows"])
    assert report["rows"][1]["images_per_s"] == pytest.approx(2 * 2 / report["rows"][1]["step_ms"] * 1e3)
    assert result.stdout.rstrip().splitlines()[-1].split()[:2] == ["2", "2"]  # the table comes last
