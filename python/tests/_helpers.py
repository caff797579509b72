"""Helpers shared by the zinf package's tests that start several processes (torchrun, mpirun) or
go through zinf.deepspeed_compat: a free port, the launchers' commands, and deepspeed.initialize
without torch.distributed."""
import importlib.util
import os
import shutil
import socket
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))

# The variables by which an MPI launcher names a process's rank: a torchrun job started from a
# shell under mpirun (or from a test run under it) must not see them, or zinf.torch would take
# the job for an MPI one.
MPI_LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a job's rendezvous (torchrun's default, 29500, may be
    taken by a job beside this one)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def why_torchrun_unavailable() -> str | None:
    """Why this torch cannot run a job under torchrun with zinf's "torch" communicator, or
    None."""
    if importlib.util.find_spec("torch.distributed.run") is None:
        return "torch.distributed.run is not available in this torch"
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        return "torch.distributed has no gloo backend in this torch"
    return None


def torchrun(script: str, args, timeout: float, ranks: int = 2, env: dict | None = None,
             dropped=MPI_LAUNCHER_VARIABLES) -> subprocess.CompletedProcess:
    """Runs python/tests/`script` with `args` in `ranks` processes under torchrun (python -m
    torch.distributed.run), meeting on a free port of 127.0.0.1, in `env` (default this
    process's environment) without the variables `dropped`. Returns the finished process, its
    output captured as text."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
               os.path.join(HERE, script), *[str(arg) for arg in args]]
    env = {k: v for k, v in (os.environ if env is None else env).items() if k not in dropped}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def mpirun(script: str, args, timeout: float, ranks: int = 2, env: dict | None = None,
           exported=()) -> subprocess.CompletedProcess:
    """Runs python/tests/`script` with `args` in `ranks` processes under mpirun, in `env`
    (default this process's environment), the variables `exported` passed to the ranks
    explicitly (-x); `script` "-c" runs the code args[0] instead (`python -c`), in python/tests.
    Returns the finished process, its output captured as text."""
    target = script if script == "-c" else os.path.join(HERE, script)
    command = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
               *[part for name in exported for part in ("-x", name)], "-np", str(ranks),
               sys.executable, target, *[str(arg) for arg in args]]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=HERE if script == "-c" else None)


def why_mpirun_unavailable() -> str | None:
    """Why no job can run under mpirun here, or None."""
    return None if shutil.which("mpirun") is not None else "no mpirun on PATH"


def ds_initialize(**kwargs):
    """deepspeed.initialize (zinf.deepspeed_compat's) in this process without initialising
    torch.distributed: the other tests of the session expect it untouched, and zinf's engine
    does not use it."""
    import zinf.deepspeed_compat as compat

    return compat.initialize(dist_init_required=False, **kwargs)
