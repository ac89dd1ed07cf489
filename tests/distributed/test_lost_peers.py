"""A lost peer of a data-parallel run: one line naming what happened and how to resume, exit status 3.

Two gloo processes on the CPU, started from the environment variables as a scheduler would
(no torchrun to stop the job), in two launches run side by side: a rank that hangs past the
group's timeout while the other broadcasts, and a rank that dies before the other's
``DistributedDataParallel`` step. A rank whose peer never joins, and the command line's report,
run in this process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from cl_streamkl.distributed.data_parallel import start_data_parallel
from cl_streamkl.distributed.lost_peers import LostPeerError, is_lost_peer, peers_checked
from cl_streamkl.experiment import cli
from cl_streamkl.experiment.config import ExperimentConfig
from cl_streamkl.experiment.outputs import write_config

pytestmark = pytest.mark.distributed

REPOSITORY = Path(__file__).resolve().parents[2]
TIMEOUT_S = 1
# Two processes' imports on two shared cores, the timeout, and plenty to spare.
DEADLINE_S = 120

RANK = '''
import json, os, sys, time
import torch
from cl_streamkl.distributed.data_parallel import start_data_parallel, stop_data_parallel

scenario, rank = sys.argv[1], int(os.environ["RANK"])


def meet(stage):
    """Wait for the other rank to reach ``stage`` (a file each rank writes), at most a minute."""
    mark = os.path.join(sys.argv[3], f"{scenario}-{stage}-")
    open(mark + str(rank), "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(mark + str(1 - rank)) and time.monotonic() < deadline:
        time.sleep(0.01)


# Both ranks meet here, imports done, before the group starts: on a loaded machine one rank's
# imports can take longer than the short timeout, which would fail the start, not the scenario.
meet("ready")
data_parallel = start_data_parallel("cpu", float(sys.argv[2]))
try:
    if scenario == "hangs":
        if rank == 1:
            time.sleep(2 * float(sys.argv[2]))  # past the timeout: rank 0 gives up, then this one finds it gone
        data_parallel.broadcast({"step": 1})
    else:
        model = data_parallel.wrap(torch.nn.Linear(4, 1))
        # Rank 1 dies only once rank 0 has its wrapped model too: dying during rank 0's wrap (its
        # broadcast of the weights) is another scenario, which a loaded machine would otherwise run.
        meet("wrapped")
        if rank == 1:
            os._exit(0)
        with data_parallel.peers_checked("training"):
            model(torch.randn(2, 4)).sum().backward()
    outcome = {"error": None}
except Exception as error:
    outcome = {"error": type(error).__name__, "message": str(error)}
stop_data_parallel(data_parallel)
print(json.dumps(outcome))
'''


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _environment(rank: int, port: int) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, list[dict]]:
    """Each scenario's outcome on rank 0 and rank 1 (the rank that dies reports nothing)."""
    folder = tmp_path_factory.mktemp("lost_peers")
    script = folder / "rank.py"
    script.write_text(RANK)
    launches = {}
    # Both ports held at once, so the two launches cannot be given the same one.
    with socket.socket() as first, socket.socket() as second:
        first.bind(("127.0.0.1", 0))
        second.bind(("127.0.0.1", 0))
        ports = first.getsockname()[1], second.getsockname()[1]
    # The dying rank's peer learns of it from the closed connection, not the timeout: a long one
    # keeps a loaded machine's slow rank within DistributedDataParallel's start (several collectives).
    for (scenario, timeout), port in zip((("hangs", TIMEOUT_S), ("dies", 60)), ports):
        launches[scenario] = [
            subprocess.Popen([sys.executable, str(script), scenario, str(timeout), str(folder)], cwd=REPOSITORY,
                             env=_environment(rank, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for rank in (0, 1)]
    found = {}
    for scenario, processes in launches.items():
        found[scenario] = []
        for process in processes:
            try:
                stdout, stderr = process.communicate(timeout=DEADLINE_S)
            finally:
                process.kill()
            lines = stdout.strip().splitlines()
            found[scenario].append(json.loads(lines[-1]) if lines else
                                   {"status": process.returncode, "stderr": stderr[-2000:]})
    return found


def test_a_rank_that_hangs_past_the_timeout_is_reported_in_one_line(outcomes):
    waited, hung = outcomes["hangs"]
    assert waited == {"error": "LostPeerError", "message": (
        "lost contact with the other processes while broadcasting rank 0's state: another process did not answer "
        f"within the {TIMEOUT_S} s timeout (--dist-timeout) (it hangs, died or is unreachable)")}
    # The hung rank, back, finds rank 0 gone (closed, or silent until its own timeout).
    assert hung["error"] == "LostPeerError", hung
    assert hung["message"].startswith("lost contact with the other processes while broadcasting rank 0's state: ")
    assert "\n" not in hung["message"]


def test_a_rank_that_dies_is_reported_by_the_training_step_in_one_line(outcomes):
    survivor = outcomes["dies"][0]
    assert survivor["error"] == "LostPeerError", survivor
    assert survivor["message"].startswith("lost contact with the other processes while training: another process ")
    assert "\n" not in survivor["message"]


def test_a_peer_that_never_joins_is_reported(monkeypatch):
    environ = _environment(0, _free_port())
    for name in ("MASTER_ADDR", "MASTER_PORT"):  # env:// reads these from the process's environment
        monkeypatch.setenv(name, environ[name])
    with pytest.raises(LostPeerError, match=r"^lost contact with the other processes while joining the process "
                                            r"group: another process did not answer within the 1 s timeout"):
        start_data_parallel("cpu", 1.0, environ=environ)
    assert not dist.is_initialized()


def test_only_reports_of_lost_peers_are_converted():
    gloo_closed = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error "
                               "[127.0.0.1]:11678: Connection reset by peer. This is typically caused by ...")
    assert is_lost_peer(gloo_closed) and is_lost_peer(dist.DistStoreError("Timed out after 3 seconds"))
    shape_bug = RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x4 and 3x1)")
    assert not is_lost_peer(shape_bug) and not is_lost_peer(ValueError("timeout"))
    with pytest.raises(RuntimeError) as caught, peers_checked("training"):
        raise shape_bug
    assert caught.value is shape_bug
    with pytest.raises(LostPeerError, match="while training: another process closed its connection"):
        with peers_checked("training"):
            raise gloo_closed


@pytest.mark.parametrize("resume", [False, True], ids=["new-run", "resume"])
def test_the_cli_names_the_lost_peer_and_how_to_resume(resume, tmp_path, monkeypatch, capsys):
    for name, value in _environment(0, _free_port()).items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "run"
    if resume:
        write_config(out, ExperimentConfig(out=str(out), device="cpu").resolved())
        argv = ["run", "--resume", str(out), "--dist-timeout", "1"]
    else:
        argv = ["run", "--device", "cpu", "--out", str(out), "--dist-timeout", "1"]
    assert cli.main(argv) == cli.LOST_PEER_STATUS == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "cl-streamkl: error: lost contact with the other processes while joining the process group: ")
    if resume:
        assert err.endswith(f"then continue with: torchrun --nproc_per_node 2 -m cl_streamkl run --resume {out}\n")
    else:
        assert err.endswith("nothing was written; stop any process of the run still running and start it again\n")
        assert not out.exists()
