"""DeepSpeed's import name over zinf.torch, so that a Hugging Face Trainer script trains on zinf.

Transformers' Trainer and Accelerate drive DeepSpeed through `import deepspeed` when
TrainingArguments(deepspeed=<config>) is given. install() makes that import find the modules
below, which map the part of DeepSpeed's API those two libraries call onto zinf.torch:

    import zinf.deepspeed_compat
    zinf.deepspeed_compat.install()      # before transformers is imported
    ...                                  # the Trainer script, unchanged

What it covers (docs/PYTHON.md, "The Hugging Face Trainer"): ZeRO stages 1-3 with the config's
offload; the optimizer from the config or the Trainer's (torch AdamW, Adam or Adagrad, turned
into the config's "optimizer" section and zinf parameter groups); gradient accumulation;
save_model (consolidated at stage 3) and checkpoints with resume; evaluate; fp16 and bf16;
models built under zero.Init (from_config). One process, or several, with
TrainingArguments(use_cpu=True), under torchrun (`torchrun --nproc-per-node N script.py`, or
`accelerate launch --multi_gpu --num_processes N script.py`, which runs it) or an MPI launcher
(`mpirun -np N python script.py`).
torch.distributed's gloo group, which Accelerate and the Trainer use for the data sampler,
gathers and barriers, has the engine's ranks: Accelerate makes it from RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT, which torchrun sets, and which install() sets from an MPI launcher's
environment as DeepSpeed's MPI discovery does. The engine's own collectives run on a gloo group
of their own under torchrun (zinf.torch makes it from Accelerate's), on its MPI communicator
under mpirun.

Beyond the Trainer path, what DeepSpeed scripts of their own call (docs/PYTHON.md, "Beyond the
Trainer"): deepspeed.utils' safe_get_full_fp32_param, safe_set_full_fp32_param and
safe_get_full_optimizer_state, RepeatingLoader and engine.training_dataloader, deepspeed.comm's
reduce, all_gather_into_tensor, reduce_scatter_tensor, get_global_rank, new_group and
point-to-point calls, a zero_to_fp32.py script written into each checkpoint directory, the
config's csv_monitor and tensorboard sections with engine.monitor (zinf._monitor), and
deepspeed.runtime.utils.see_memory_usage.

What it refuses, each with an error that says so: sequence parallelism (Ulysses), tensor
parallelism (autotp), an mpu, several processes without a launcher (WORLD_SIZE > 1 but no RANK
and no MPI launcher: no rank is known), several processes that Accelerate counts as one (no
use_cpu=True on a machine without a GPU: each would train on the whole data), and a parameter's
full gradient (safe_get_full_grad: the engine keeps none) or the writing of a gradient or moment.

No `deepspeed` distribution is installed: the modules are registered in sys.modules, and a finder
on sys.meta_path answers importlib.util.find_spec and importlib.metadata for the name, which
Transformers and Accelerate check before they use it.
"""
from __future__ import annotations

import gc
import importlib.abc
import importlib.machinery
import importlib.metadata
import json
import logging
import math
import os
import pathlib
import re
import sys
import types
import weakref

import torch

import zinf._monitor as _monitor
import zinf.torch as _zt
import zinf.zero_to_fp32 as _zero_to_fp32

# The DeepSpeed release whose API this module stands for, with "+zinf" as a PEP 440 local
# version. Transformers and Accelerate compare it to turn features on (Accelerate's tensor
# parallelism wants >= 0.16.4, its DeepSpeedCPUAdam mapping >= 0.3.1); 0.18.0 is the release
# whose Trainer path this module was checked against. It claims the call shapes below, not
# DeepSpeed's kernels, launcher or features outside that path.
VERSION = "0.18.0+zinf"

_DEEPSPEED_NAME = "deepspeed"

_METADATA = f"""\
Metadata-Version: 2.1
Name: {_DEEPSPEED_NAME}
Version: {VERSION}
Summary: DeepSpeed's API for the Hugging Face Trainer, over zinf.torch (zinf.deepspeed_compat)
Author: zinf
"""


def _mpi_launcher() -> tuple[int, int, int, int] | None:
    """(rank, size, local_rank, local_size) of this process as an MPI launcher states them: Open
    MPI's mpirun (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE) or MPICH's and Intel
    MPI's Hydra (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS), or Slurm's srun with
    PMIx (_srun_pmix()). None when none of them started the process, or when torchrun did
    (`srun torchrun ...`, `mpirun torchrun ...`: the workers inherit the variables of the task
    that ran torchrun, which describe the torchrun processes, not them). zinf.torch opens its
    engine's communicator (MpiComm) under the same launchers (_choose_comm)."""
    if _zt._started_by_torchrun():
        return None
    for rank_key, size_key, local_key, local_size_key in (
            ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
             "OMPI_COMM_WORLD_LOCAL_SIZE"),
            ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")):
        rank, size = os.environ.get(rank_key, ""), os.environ.get(size_key, "")
        if rank.isdigit() and size.isdigit():
            local, local_size = os.environ.get(local_key, ""), os.environ.get(local_size_key, "")
            return (int(rank), int(size), int(local) if local.isdigit() else 0,
                    int(local_size) if local_size.isdigit() else int(size))
    return _srun_pmix()


def _srun_pmix() -> tuple[int, int, int, int] | None:
    """(rank, size, local_rank, local_size) of a task srun started with PMIx (srun --mpi=pmix):
    PMIX_RANK (set only in such a task; SLURM_PROCID is set in the batch script's own shell too),
    SLURM_STEP_NUM_TASKS (else SLURM_NTASKS), SLURM_LOCALID, and this node's task count, its
    entry (SLURM_NODEID) of SLURM_STEP_TASKS_PER_NODE (else SLURM_TASKS_PER_NODE), which lists
    counts with repeats ("2(x3),1": three nodes of 2, then one of 1). None without PMIX_RANK or
    a task count."""
    rank = os.environ.get("PMIX_RANK", "")
    size = os.environ.get("SLURM_STEP_NUM_TASKS", os.environ.get("SLURM_NTASKS", ""))
    if not (rank.isdigit() and size.isdigit()):
        return None
    local = os.environ.get("SLURM_LOCALID", "")
    per_node = []
    spec = os.environ.get("SLURM_STEP_TASKS_PER_NODE", os.environ.get("SLURM_TASKS_PER_NODE", ""))
    for item in filter(None, spec.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item)
        if m is None:
            per_node = []
            break
        per_node += [int(m.group(1))] * int(m.group(2) or 1)
    node = os.environ.get("SLURM_NODEID", "")
    nodes = os.environ.get("SLURM_STEP_NUM_NODES", os.environ.get("SLURM_NNODES", "1"))
    if node.isdigit() and int(node) < len(per_node):
        local_size = per_node[int(node)]
    elif nodes == "1":
        local_size = int(size)
    else:
        # Several nodes, this one's count not stated: 1, which tells _launcher_environment
        # that the tasks are not all here (it then needs MASTER_ADDR).
        local_size = 1
    return int(rank), int(size), int(local) if local.isdigit() else 0, local_size


def _torchrun() -> tuple[int, int, int, int] | None:
    """(rank, size, local_rank, local_size) of this process as torchrun (or `accelerate launch
    --multi_gpu`, which runs it) states them: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    with WORLD_SIZE > 1 and either torchrun's TORCHELASTIC_RUN_ID or no MPI launcher's
    variables, the case where zinf.torch opens its engine's communicator on a gloo group of
    torch.distributed (comm="torch"). None otherwise."""
    if (not _zt._started_by_torchrun()
            and any(v in os.environ for v in _zt._MPI_LAUNCHER_VARIABLES)):
        return None  # _mpi_launcher()'s case
    rank, size = os.environ.get("RANK", ""), os.environ.get("WORLD_SIZE", "")
    if not (rank.isdigit() and size.isdigit()) or int(size) <= 1:
        return None
    local, local_size = os.environ.get("LOCAL_RANK", ""), os.environ.get("LOCAL_WORLD_SIZE", "")
    return (int(rank), int(size), int(local) if local.isdigit() else 0,
            int(local_size) if local_size.isdigit() else int(size))


def _launcher() -> tuple[tuple[int, int, int, int], str] | None:
    """This process's (rank, size, local_rank, local_size) and its launcher's name: an MPI
    launcher's, else torchrun's; None for one process."""
    mpi = _mpi_launcher()
    if mpi is not None:
        return mpi, "the MPI launcher"
    torchrun = _torchrun()
    return None if torchrun is None else (torchrun, "torchrun")


def _refuse_without_launcher(call: str):
    """Several processes (WORLD_SIZE > 1) that neither an MPI launcher nor torchrun started: no
    RANK says which rank this process is, so neither torch.distributed nor zinf's engine can
    form the group."""
    size = os.environ.get("WORLD_SIZE", "")
    if (size.isdigit() and int(size) > 1 and _torchrun() is None
            and not any(v in os.environ for v in _zt._MPI_LAUNCHER_VARIABLES)):
        raise NotImplementedError(
            f"{call} (zinf.deepspeed_compat): WORLD_SIZE={size} without RANK and without an "
            "MPI launcher; launch the Trainer script with torchrun --nproc-per-node N "
            "script.py, which sets RANK, or with mpirun -np N python script.py")


# ---- deepspeed.comm -----------------------------------------------------------------------------
# Accelerate and the Trainer use torch.distributed once it is set up: the data loader gives
# each rank its share of the batches by its rank and the world size, the logged loss and the
# evaluation's outputs are gathered over the ranks, and saving waits at barriers. That default
# group is gloo, of the launcher's processes: made by Accelerate itself with
# TrainingArguments(use_cpu=True), from the environment torchrun set or install() set from an MPI
# launcher's, or else by init_distributed, as DeepSpeed's does with its MPI discovery under
# mpirun. zinf's engine never runs its collectives on it: under an MPI launcher they run on its
# own MPI communicator, under torchrun on a gloo group of its own that zinf.torch.initialize()
# makes from it (dist.new_group), so that the Trainer's calls and the engine's never interleave.

def _launcher_environment(call: str, distributed_port: int = 29500) -> tuple[int, int, int]:
    """Under an MPI launcher of several processes, sets what torch.distributed's env://
    rendezvous and Accelerate read, as DeepSpeed's MPI discovery does: RANK, WORLD_SIZE,
    LOCAL_RANK and LOCAL_WORLD_SIZE from the launcher, MASTER_ADDR (127.0.0.1 when every process
    is on this machine) and MASTER_PORT (distributed_port) unless the environment has them.
    torchrun sets them itself. Returns (rank, size, local_rank); (0, 1, 0) without a launcher."""
    _refuse_without_launcher(call)
    torchrun = _torchrun()
    if torchrun is not None:
        return torchrun[:3]
    launcher = _mpi_launcher()
    if launcher is None:
        return 0, 1, 0
    rank, size, local_rank, local_size = launcher
    for key, value in (("RANK", rank), ("WORLD_SIZE", size), ("LOCAL_RANK", local_rank),
                       ("LOCAL_WORLD_SIZE", local_size)):
        given = os.environ.get(key)
        if given is not None and given != str(value):
            raise ValueError(f"{call} (zinf.deepspeed_compat): {key}={given} in the "
                             f"environment, but the MPI launcher says {value}")
        os.environ[key] = str(value)
    if "MASTER_ADDR" not in os.environ:
        if local_size != size:
            raise ValueError(
                f"{call} (zinf.deepspeed_compat): the MPI job spans several "
                "machines; set MASTER_ADDR to the address of rank 0's machine (DeepSpeed finds "
                "it through mpi4py, which zinf does not use)")
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ.setdefault("MASTER_PORT", str(distributed_port))
    return rank, size, local_rank


def init_distributed(dist_backend=None, auto_mpi_discovery=True, distributed_port=29500,
                     verbose=True, timeout=None, init_method=None, dist_init_required=None,
                     config=None, rank=-1, world_size=-1):
    """deepspeed.init_distributed (Accelerate's PartialState, initialize()): the default
    torch.distributed group, on gloo whatever dist_backend asks (zinf computes on the CPU). In one
    process a one-rank group with an in-memory store; under torchrun or an MPI launcher of
    several processes a group of them all, met through MASTER_ADDR:MASTER_PORT
    (_launcher_environment). Returns at once when torch.distributed is initialised already
    (Accelerate does so itself on the CPU, TrainingArguments(use_cpu=True), from the same
    environment). Several processes without RANK (neither torchrun nor an MPI launcher) are
    refused."""
    del dist_backend, auto_mpi_discovery, verbose, dist_init_required, config
    launcher_rank, launcher_size, _ = _launcher_environment("deepspeed.init_distributed",
                                                            distributed_port)
    if rank not in (-1, launcher_rank) or world_size not in (-1, launcher_size):
        raise ValueError(f"deepspeed.init_distributed (zinf.deepspeed_compat): rank={rank}, "
                         f"world_size={world_size} given, but the launcher says rank "
                         f"{launcher_rank} of {launcher_size}")
    if torch.distributed.is_initialized():
        _check_world("init_distributed")
        return
    options = {} if timeout is None else {"timeout": timeout}
    if launcher_size == 1:
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(),
                                             rank=0, world_size=1, **options)
    else:
        torch.distributed.init_process_group("gloo", init_method=init_method or "env://",
                                             rank=launcher_rank, world_size=launcher_size,
                                             **options)


def _check_world(call: str):
    """torch.distributed's group must be the launcher's processes, in the launcher's order, as
    the engine's communicator is, or the Trainer's data shares would not be the engine's
    ranks."""
    (rank, size, _, _), name = _launcher() or ((0, 1, 0, 1), "the launcher")
    got = (torch.distributed.get_rank(), torch.distributed.get_world_size())
    if got != (rank, size):
        raise RuntimeError(f"deepspeed.{call} (zinf.deepspeed_compat): torch.distributed is "
                           f"rank {got[0]} of {got[1]}, but {name} says rank {rank} of "
                           f"{size}; zinf's engine takes its ranks from the launcher")


def _check_accelerate_processes():
    """Accelerate shards the Trainer's data over the processes it counts. On a machine without a
    GPU it counts those of torchrun or an MPI launcher only with TrainingArguments(use_cpu=True)
    (its MULTI_CPU mode); otherwise it sees one process on every rank, and each rank would train
    on the whole data and save as the main process."""
    state = getattr(sys.modules.get("accelerate.state"), "PartialState", None)
    counted = getattr(state, "_shared_state", {}).get("num_processes")
    (_, size, _, _), name = _launcher() or ((0, 1, 0, 1), "the launcher")
    if counted is not None and counted != size:
        raise NotImplementedError(
            f"deepspeed.initialize (zinf.deepspeed_compat): Accelerate counts {counted} "
            f"process(es) but {name} started {size}; zinf computes on the CPU, where "
            "Accelerate spreads the data over the processes with TrainingArguments(use_cpu=True)"
            ": pass it")


def _comm_is_initialized() -> bool:
    return torch.distributed.is_initialized()


def _comm_get_rank(group=None) -> int:
    """The rank in torch.distributed's group; before it is initialised (a model built under
    zero.Init ahead of the Trainer), the launcher's."""
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank(group)
    launcher = _launcher()
    return 0 if launcher is None else launcher[0][0]


def _comm_get_world_size(group=None) -> int:
    if torch.distributed.is_initialized():
        return torch.distributed.get_world_size(group)
    launcher = _launcher()
    return 1 if launcher is None else launcher[0][1]


def _comm_get_local_rank() -> int:
    launcher = _launcher()
    return 0 if launcher is None else launcher[0][2]


def _comm_barrier(group=None, async_op=False, device_ids=None, **kwargs):
    """torch.distributed's barrier on the gloo group (DeepSpeed's profiling options do
    nothing); nothing to wait for before it is initialised, in one process."""
    if torch.distributed.is_initialized():
        return torch.distributed.barrier(group, async_op=async_op)
    return None


def _comm_all_reduce(tensor, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
    return torch.distributed.all_reduce(tensor, op=op, group=group, async_op=async_op)


def _comm_broadcast(tensor, src, group=None, async_op=False):
    return torch.distributed.broadcast(tensor, src, group=group, async_op=async_op)


def _comm_all_gather(tensor_list, tensor, group=None, async_op=False):
    return torch.distributed.all_gather(tensor_list, tensor, group=group, async_op=async_op)


# The collectives below are deepspeed.comm's over torch.distributed's (deepspeed/comm/comm.py,
# TorchBackend), with DeepSpeed's argument order; on the gloo group, as the ones above.

def _comm_reduce(tensor, dst, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False,
                 **kwargs):
    """The ranks' `tensor` reduced by `op` into rank dst's."""
    return torch.distributed.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def _comm_all_gather_into_tensor(output_tensor, tensor, group=None, async_op=False, **kwargs):
    """Every rank's `tensor` into `output_tensor`, rank after rank (world size x its elements)."""
    return torch.distributed.all_gather_into_tensor(output_tensor, tensor, group=group,
                                                    async_op=async_op)


def _comm_reduce_scatter_tensor(output_tensor, tensor, op=torch.distributed.ReduceOp.SUM,
                                group=None, async_op=False, **kwargs):
    """The ranks' `tensor` reduced by `op`; rank r keeps the r-th of world-size equal slices."""
    return torch.distributed.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group,
                                                   async_op=async_op)


def _comm_get_global_rank(group=None, group_rank=0) -> int:
    """The global rank of `group`'s rank group_rank (group None: the default group's, itself)."""
    if group is None or group is torch.distributed.GroupMember.WORLD:
        return int(group_rank)
    return torch.distributed.get_global_rank(group, group_rank)


def _comm_new_group(ranks):
    """A torch.distributed gloo group of `ranks` (collective: every rank of the default group
    calls it, as torch's new_group requires), for the collectives above. zinf's engine never
    runs on it: its data-parallel group is always every rank."""
    return torch.distributed.new_group(ranks=list(ranks))


def _comm_send(tensor, dst, group=None, tag=0):
    return torch.distributed.send(tensor, dst, group=group, tag=tag)


def _comm_recv(tensor, src=None, group=None, tag=0):
    return torch.distributed.recv(tensor, src, group=group, tag=tag)


def _comm_isend(tensor, dst, group=None, tag=0):
    return torch.distributed.isend(tensor, dst, group=group, tag=tag)


def _comm_irecv(tensor, src=None, group=None, tag=0):
    return torch.distributed.irecv(tensor, src, group=group, tag=tag)


# ---- deepspeed.accelerator ----------------------------------------------------------------------

class _CpuAccelerator:
    """deepspeed.accelerator.get_accelerator()'s answer: the CPU. Transformers asks it for the
    device to load a checkpoint's tensors to (deepspeed_load_checkpoint) and for seeding."""

    def device_name(self, device_index=None) -> str:
        return "cpu"

    def current_device_name(self) -> str:
        return "cpu"

    def device(self, device_index=None):
        """None, as DeepSpeed's CPU accelerator answers (it has no device object)."""
        return None

    def current_device(self) -> int:
        """LOCAL_RANK (0 when unset), the variable DeepSpeed's CPU accelerator reads, which
        the launchers and deepspeed.init_distributed() set: this process's rank on its machine.
        DeepSpeed's returns the variable's text where it is set; this returns it as an int."""
        value = os.environ.get("LOCAL_RANK", "")
        if value == "":
            return 0
        if not value.isdigit():
            raise ValueError(f"get_accelerator().current_device(): LOCAL_RANK is {value!r}, not a "
                             "process's rank on its machine (0, 1, ...); unset it, or let the "
                             "launcher set it")
        return int(value)

    def device_count(self) -> int:
        return 1

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return "gloo"

    def empty_cache(self):
        pass

    def synchronize(self, device_index=None):
        pass

    def manual_seed(self, seed: int):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int):
        torch.manual_seed(seed)

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return True

    def set_device(self, device_index):
        pass


_ACCELERATOR = _CpuAccelerator()


def get_accelerator() -> _CpuAccelerator:
    return _ACCELERATOR


# ---- deepspeed.runtime.zero.partition_parameters ------------------------------------------------
# Transformers' prevent_arange_dtype_change() swaps zero_wrapper_for_fp_tensor_constructor while
# zero.Init is entered and tests functions against _orig_torch_arange. zinf's Init does not wrap
# torch's tensor constructors, so the wrapper returns the function as it is.

_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype=None, target_device=None):
    return fn


# ---- deepspeed.ops ------------------------------------------------------------------------------

class _Description(torch.optim.Optimizer):
    """A DeepSpeed optimizer class's signature that only describes the optimizer for
    initialize(): the engine's step() applies it, so its own step() raises, naming `_name`."""

    _name = ""

    def _refuse_half_state(self, fp32_optimizer_states):
        """DeepSpeed's fp32_optimizer_states=False keeps the optimizer state in the parameters'
        dtype; the engine keeps it in fp32, so it is refused rather than trained otherwise."""
        if not fp32_optimizer_states:
            raise NotImplementedError(f"{self._name} (zinf.deepspeed_compat): "
                                      "fp32_optimizer_states=False has no zinf equivalent (the "
                                      "engine keeps the optimizer state in fp32)")

    def step(self, closure=None):
        raise RuntimeError(f"{self._name} (zinf.deepspeed_compat) only describes the optimizer "
                           "for deepspeed.initialize(); the engine's step() applies it")


class DeepSpeedCPUAdam(_Description):
    """What Accelerate makes of the Trainer's optimizer when the config offloads the optimizer
    (map_pytorch_optim_to_deepspeed): a description of the groups and hyper-parameters, which
    initialize() turns into the config's "optimizer" section. It never steps: zinf's engine runs
    the optimizer. fp32_optimizer_states=False is refused, as DeepSpeedCPUAdagrad refuses it."""

    _name = "DeepSpeedCPUAdam"

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0, amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
        if amsgrad or not bias_correction:
            raise NotImplementedError("DeepSpeedCPUAdam (zinf.deepspeed_compat): amsgrad=True "
                                      "or bias_correction=False have no zinf equivalent")
        self._refuse_half_state(fp32_optimizer_states)
        self.adamw_mode = adamw_mode
        super().__init__(model_params, dict(lr=lr, betas=betas, eps=eps,
                                            weight_decay=weight_decay))


class FusedAdam(DeepSpeedCPUAdam):
    """deepspeed.ops.adam.FusedAdam's signature (its decoupled-decay switch is adam_w_mode, where
    DeepSpeedCPUAdam's is adamw_mode): described for initialize() as DeepSpeedCPUAdam is."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True):
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad, adamw_mode=adam_w_mode)


class DeepSpeedCPUAdagrad(_Description):
    """deepspeed.ops.adagrad.DeepSpeedCPUAdagrad's signature (deepspeed/ops/adagrad/
    cpu_adagrad.py), which is not torch's Adagrad's: no lr_decay nor initial_accumulator_value
    (its state sum starts at 0), and eps third. What Accelerate makes of torch's Adagrad under
    optimizer offload (map_pytorch_optim_to_deepspeed passes the torch optimizer's param_groups
    and its lr and weight_decay); initialize() turns it into the config's "Adagrad" section, as
    DeepSpeedCPUAdam. It never steps: zinf's engine runs the optimizer.

    DeepSpeed keeps amsgrad in the groups but its update (csrc/adagrad/cpu_adagrad.cpp) never
    reads it: amsgrad=True trains as False, here too. fp32_optimizer_states=False (the state in
    the parameters' dtype) is refused, as it is in a config's "optimizer" section: the engine
    keeps its state in fp32."""

    _name = "DeepSpeedCPUAdagrad"

    def __init__(self, model_params, lr=1e-2, eps=1e-10, weight_decay=0, amsgrad=False,
                 fp32_optimizer_states=True):
        self._refuse_half_state(fp32_optimizer_states)
        super().__init__(model_params, dict(lr=lr, eps=eps, weight_decay=weight_decay,
                                            amsgrad=amsgrad))


# ---- deepspeed.utils, deepspeed.checkpoint.utils ------------------------------------------------

logger = logging.getLogger("DeepSpeed")


def log_dist(message, ranks=None, level=logging.INFO):
    logger.log(level, message)


def _process_memory_bytes() -> tuple[int, int]:
    """(resident bytes, peak resident bytes) of this process, from /proc/self/status (Linux)."""
    figures = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                figures[key] = int(value.split()[0]) * 1024  # stated in kB
    return figures.get("VmRSS", 0), figures.get("VmHWM", 0)


def _machine_memory_used() -> tuple[int, float]:
    """(bytes in use, percent of the total) of the machine's memory, as psutil's
    virtual_memory() counts it (total less available), from /proc/meminfo."""
    figures = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                figures[key] = int(value.split()[0]) * 1024
    total = figures.get("MemTotal", 0)
    used = total - figures.get("MemAvailable", total)
    return used, (100.0 * used / total if total else 0.0)


def see_memory_usage(message, force=False):
    """deepspeed.runtime.utils.see_memory_usage: nothing unless force is true, nor on a rank
    other than 0 (deepspeed.comm's rank: torch.distributed's, or the launcher's before it is
    initialised), as DeepSpeed's. Otherwise, after a garbage collection, prints `message`, this
    process's resident memory (now and at its peak), the machine's memory in use (DeepSpeed's
    "CPU Virtual Memory" line) and, for each engine of this process, the bytes of its state on
    the device, the host and NVMe (engine.memory()): where DeepSpeed prints the accelerator's
    allocator figures, zinf's device memory is the engine's. An engine whose initialize() failed
    before it was finalized (one still referenced, by a kept exception say) has no buffers and
    is left out; the call never raises for an engine."""
    if not force or _comm_get_rank() != 0:
        return
    gc.collect()
    gib = 1024**3
    rss, peak = _process_memory_bytes()
    used, percent = _machine_memory_used()
    lines = [str(message),
             f"CPU RSS {rss / gib:.2f} GB, peak {peak / gib:.2f} GB",
             f"CPU Virtual Memory:  used = {used / gib:.2f} GB, percent = {percent:.1f}%"]
    for engine in sorted(_zt._open_engines, key=lambda e: e._serial):
        if not engine._core.finalized:
            continue
        name = f"engine {engine._serial} (rank {engine.global_rank})"
        try:
            memory = engine.memory()
        except Exception as error:  # a diagnostic print does not stop the training script
            lines.append(f"{name}: memory not available: {error}")
            continue
        lines.append(f"{name}: device {memory['device_bytes'] / gib:.2f} GB, host "
                     f"{memory['host_bytes'] / gib:.2f} GB, NVMe "
                     f"{memory['nvme_bytes'] / gib:.2f} GB")
    print("\n".join(lines), flush=True)


def set_z3_leaf_modules(model, leaf_module_classes):
    """Accelerate's ZeRO-3 setting for mixture-of-experts blocks: DeepSpeed then gathers such a
    block as one piece. zinf gathers per module that owns parameters whatever the block, so
    nothing changes; returns the modules marked, none."""
    return []


def get_z3_leaf_modules(model):
    return []


def clone_tensors_for_torch_save(item, device=None, _copies=None):
    """deepspeed.checkpoint.utils.clone_tensors_for_torch_save: a copy of a nest of tensors
    whose storage holds just them. Accelerate passes the model's state_dict() through it at
    stages 1 and 2 before the Trainer's save_model writes it. Unlike DeepSpeed's, a tensor that
    appears under several names (tied weights: GPT-2's lm_head.weight is
    transformer.wte.weight) stays one tensor, so that the file saved is the one the Trainer
    writes without DeepSpeed, with the tied name left out."""
    copies = {} if _copies is None else _copies
    if torch.is_tensor(item):
        # state_dict() detaches each name's tensor anew, so the same values are recognised by
        # their memory: the same address, shape, strides and dtype.
        key = (item.data_ptr(), tuple(item.shape), item.stride(), item.dtype)
        if item.numel() == 0 or key not in copies:
            detached = item.detach() if device is None else item.detach().to(device)
            copies[key] = detached.clone()
        return copies[key]
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device, copies)
                           for k, v in item.items()})
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device, copies) for v in item)
    return item


class RepeatingLoader:
    """deepspeed.runtime.dataloader.RepeatingLoader (and deepspeed.utils'): iterates over
    `loader` for ever, starting it again each time it is exhausted. Each new pass is a new
    iter(loader), so the loader initialize() returns (engine.training_dataloader) reshuffles with
    the next epoch, as DeepSpeed's does."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(self.loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


# ---- deepspeed.utils: one parameter's full fp32 state (deepspeed/utils/tensor_fragment.py) ------
# DeepSpeed's functions find the optimizer from attributes it sets on each parameter; here the
# engine that deepspeed.initialize() made is found by the parameter's id, kept with weak
# references so that neither outlives the caller's. Like DeepSpeed's at stage 3 they are
# collective: every rank calls them for the same parameters in the same order.

_param_engines: dict[int, tuple] = {}  # id(param) -> (weakref to param, weakref to engine)


def _remember_parameters(engine: "DeepSpeedEngine"):
    for key in [k for k, (param, _) in _param_engines.items() if param() is None]:
        del _param_engines[key]
    own = weakref.ref(engine)
    for param in engine.module.parameters():
        _param_engines[id(param)] = (weakref.ref(param), own)


def _engine_of(param) -> "DeepSpeedEngine | None":
    """The live engine that trains `param`, or None (a tensor no engine of deepspeed.initialize()
    holds, as DeepSpeed's functions return None for a parameter without its mapping)."""
    entry = _param_engines.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


def _trained_name(engine: "DeepSpeedEngine", param) -> str | None:
    """The engine's name of `param` when the engine trains it (an fp32 master and optimizer
    state); None for a frozen parameter (requires_grad False at initialize()), which has none in
    DeepSpeed's optimizer either."""
    pid = id(param)
    if pid not in engine._params or pid in engine._no_grad:
        return None
    return engine._names[pid]


def safe_get_full_fp32_param(param):
    """deepspeed.utils.safe_get_full_fp32_param: the parameter's fp32 master, whole, in its full
    shape (at stage 3 too), a new CPU tensor on every rank. Collective (Engine.read_parameters).
    None for a tensor the engine does not train (a frozen parameter, another module's)."""
    engine = _engine_of(param)
    name = None if engine is None else _trained_name(engine, param)
    return None if name is None else engine.read_parameter(name)


def safe_set_full_fp32_param(param, value):
    """deepspeed.utils.safe_set_full_fp32_param: replaces the parameter's fp32 master with
    `value` (its full shape, any float dtype), and the model's copy follows, as DeepSpeed's
    update of the master does at its next step. Collective: every rank passes the same value, as
    with DeepSpeed (each of its ranks copies its own slice from its own value); zinf writes
    rank 0's (Engine.write_parameters). The optimizer moments stay. Refused between a backward
    and its step (the engine holds gradients reduced against the old values). Nothing happens
    for a tensor the engine does not train, as DeepSpeed's does nothing without its mapping."""
    engine = _engine_of(param)
    name = None if engine is None else _trained_name(engine, param)
    if name is None:
        return
    shape = tuple(engine._shapes[id(param)])
    if tuple(value.shape) != shape and value.numel() != math.prod(shape):
        raise ValueError(f"safe_set_full_fp32_param('{name}'): value of shape "
                         f"{tuple(value.shape)}, the parameter's is {shape}")
    if engine._micro_batches_pending:
        # Refused alike on every rank, before the collective (the engine's own refusal would
        # abort the communicator).
        raise RuntimeError(
            f"safe_set_full_fp32_param('{name}') (zinf.deepspeed_compat): the engine holds "
            "gradients reduced since the last step, against the present values; call it after "
            "engine.step() and before the next engine.backward()")
    values = value.detach().to(device="cpu", dtype=torch.float32).reshape(shape).contiguous()
    # The parameter is the block: at stages 1 and 2 its view goes back to the engine's device
    # copy, which the write rewrote, where the script had pointed its .data elsewhere.
    engine._write_parameters([(param, values)], root=0, block=[param])


def safe_get_full_grad(param):
    """deepspeed.utils.safe_get_full_grad. A parameter's .grad when it has one (DeepSpeed's
    first answer), and None for a tensor the engine does not train (DeepSpeed's for a parameter
    without gradients). Otherwise refused: zinf's engine takes each gradient as the backward
    produces it and reduces it into the ranks' partitions (on the device, host or NVMe, partly
    consumed by an overlapped step), and keeps no full copy that could be read back."""
    if param.grad is not None:
        return param.grad
    engine = _engine_of(param)
    name = None if engine is None else _trained_name(engine, param)
    if name is None:
        return None
    raise NotImplementedError(
        f"deepspeed.utils.safe_get_full_grad('{name}') (zinf.deepspeed_compat): zinf's engine "
        "reduces each gradient into its partitions as the backward produces it and keeps no "
        "full copy to read back. For the global gradient norm use engine.get_global_grad_norm() "
        "after the step; to see this rank's gradient of each micro-batch (multiplied by the loss "
        "scale) before the engine takes it, register a hook: param.register_hook(fn)")


def safe_set_full_grad(param, value):
    """deepspeed.utils.safe_set_full_grad: refused (see safe_get_full_grad)."""
    raise NotImplementedError(
        "deepspeed.utils.safe_set_full_grad (zinf.deepspeed_compat): zinf's engine reduces each "
        "gradient into its partitions during the backward and offers no way to replace it; to "
        "change a gradient, change it in a hook before the engine takes it: "
        "param.register_hook(lambda grad: new_grad)")


# The optimizer state keys DeepSpeed's optimizers use, and the piece of a zinf rank file each is
# (lib/tier/state_store.hpp Piece: 0 the master, 1 exp_avg, 2 exp_avg_sq; docs/ENGINE.md
# "Checkpoints", "Format").
# The moments each optimizer keeps, by the config's optimizer type (lower-cased).
_OPTIMIZER_STATES = {"adam": ("exp_avg", "exp_avg_sq"), "adamw": ("exp_avg", "exp_avg_sq"),
                     "adagrad": ("exp_avg_sq",), "lion": ("exp_avg",)}


def safe_get_full_optimizer_state(param, optim_state_key):
    """deepspeed.utils.safe_get_full_optimizer_state: the parameter's optimizer state
    `optim_state_key` ("exp_avg", "exp_avg_sq": Adam and AdamW have both, Adagrad exp_avg_sq (its
    sum of squares), Lion exp_avg), whole, in the parameter's full shape, a new fp32 CPU tensor
    on every rank; ValueError for a key the optimizer does not have, as DeepSpeed's. None for a
    tensor the engine does not train. Collective (Engine.read_optimizer_state): each rank reads
    its part of the parameter only (from NVMe, where the state lives there, the swap blocks that
    hold it: the parameter's bytes and at most two blocks more per call)."""
    engine = _engine_of(param)
    name = None if engine is None else _trained_name(engine, param)
    if name is None:
        return None
    kept = _OPTIMIZER_STATES.get(engine._optimizer_name.lower(), ("exp_avg", "exp_avg_sq"))
    if optim_state_key not in kept:
        raise ValueError(f"{optim_state_key} not found in optimizer state")
    out = torch.empty(engine._shapes[id(param)], dtype=torch.float32)
    engine._core.read_optimizer_state(name, optim_state_key, out)
    return out


def safe_set_full_optimizer_state(param, value, optim_state_key):
    """deepspeed.utils.safe_set_full_optimizer_state: refused. The engine writes a parameter's
    master (safe_set_full_fp32_param) but has no call that writes its moments."""
    raise NotImplementedError(
        "deepspeed.utils.safe_set_full_optimizer_state (zinf.deepspeed_compat): zinf's engine "
        "has no call that replaces a parameter's optimizer moments; safe_set_full_fp32_param "
        "replaces its fp32 master, and a checkpoint (engine.load_checkpoint) replaces the whole "
        "optimizer state")


def tp_model_init(model, tp_size, dtype, config=None, **kwargs):
    """Transformers calls this for the config's tensor_parallel.autotp_size > 1."""
    raise NotImplementedError("deepspeed.tp_model_init (zinf.deepspeed_compat): tensor "
                              "parallelism (autotp) is not supported; remove the config's "
                              "\"tensor_parallel\" section")


# ---- deepspeed.runtime.engine.DeepSpeedEngine ---------------------------------------------------

class DeepSpeedEngine(_zt.ZinfEngine):
    """zinf's engine with what the Trainer and Accelerate read from DeepSpeed's: the config as a
    dict, backward's scale_wrt_gas, and a save_checkpoint that may be called twice for one
    checkpoint; and DeepSpeed's monitor, engine.monitor, to which backward() and step() write
    DeepSpeed's training events. initialize() makes it from the ZinfEngine that
    zinf.torch.initialize() built, and sets engine.monitor."""

    @property
    def config(self) -> dict:
        """DeepSpeedEngine.config: the config dict (the Trainer reads its ZeRO stage)."""
        return self._config

    @property
    def training_dataloader(self):
        """The loader initialize() made from training_data (the one it returned), or None, as
        DeepSpeed's engine keeps it."""
        return self.__dict__.get("_compat_training_dataloader")

    def backward(self, loss, allreduce_gradients=True, release_loss=False, retain_graph=False,
                 scale_wrt_gas=True, **kwargs):
        """DeepSpeed's signature, in its order. DeepSpeed divides the loss by
        gradient_accumulation_steps, unless scale_wrt_gas is False: the Trainer passes False,
        having divided the loss itself, so that DeepSpeed's sum of the micro-batches' gradients
        is the step's. zinf's engine averages the micro-batches (it divides their sum by
        gradient_accumulation_steps at the step), so with scale_wrt_gas=False the loss is
        multiplied by that count here, which makes the same sum. allreduce_gradients and
        release_loss do nothing, as in DeepSpeed (which warns that the first is deprecated and
        ignored when it is False)."""
        if kwargs:
            raise NotImplementedError(f"DeepSpeedEngine.backward (zinf.deepspeed_compat): "
                                      f"options {sorted(kwargs)} are not supported")
        if not allreduce_gradients:
            logger.warning("DeepSpeedEngine.backward: the argument allreduce_gradients is "
                           "deprecated and ignored (as in DeepSpeed): the gradients are reduced")
        if scale_wrt_gas:
            # The loss divided by the steps (zinf.torch's backward returns that).
            result = super().backward(loss, retain_graph=retain_graph)
        else:
            # The loss as given; the engine's average over the steps becomes the sum.
            self._run_backward(loss, retain_graph, self.gradient_accumulation_steps())
            result = loss
        monitor = self.__dict__.get("monitor")
        if monitor is not None and monitor.enabled:
            # DeepSpeed's train_loss: the sum over the step's micro-batches of each loss's mean
            # as its backward takes it (divided by gradient_accumulation_steps unless
            # scale_wrt_gas is False), which is the value returned: so the micro-batches' mean;
            # written at the backward that completes the accumulation, with the samples of the
            # steps before this one.
            logged = result.detach().mean()
            losses = self.__dict__.get("_monitor_losses")
            self._monitor_losses = logged if losses is None else losses + logged
            # Asked after the backward, which counted this micro-batch: so also where every
            # backward of the accumulation comes before a single step().
            boundary = self.is_gradient_accumulation_boundary()
            if boundary and self.global_rank == 0:
                monitor.write_events([("Train/Samples/train_loss", self._monitor_losses.item(),
                                       self.global_samples)])
        return result

    def step(self, lr_kwargs=None):
        """zinf's step; then, where it took an optimizer step (applied or skipped for an fp16
        overflow) and engine.monitor is enabled, rank 0 writes DeepSpeed's events of the step:
        the learning rate of the first parameter group for the next step, and with fp16 the
        loss scale the next step uses, both at the samples of the steps taken so far."""
        steps_before = self.global_steps
        super().step(lr_kwargs)
        monitor = self.__dict__.get("monitor")
        if (monitor is None or not monitor.enabled or self.global_steps == steps_before
                or self.global_rank != 0):
            return
        events = [("Train/Samples/lr", self.get_lr()[0], self.global_samples)]
        if self.fp16_enabled():
            # DeepSpeed's scaler holds the initial scale as an int (2**initial_scale_power)
            # until it first changes it, by a float factor: its rows read "256" until then and
            # "512.0" after.
            scale = self.optimizer.cur_scale
            if self.__dict__.get("_monitor_scale_moved") is False:
                if scale == self._monitor_initial_scale and float(scale).is_integer():
                    scale = int(scale)
                else:
                    self._monitor_scale_moved = True
            events.append(("Train/Samples/loss_scale", scale, self.global_samples))
        monitor.write_events(events)

    def destroy(self):
        """zinf's destroy(); first the monitors are closed (the TensorBoard writer's thread
        ends)."""
        monitor = self.__dict__.get("monitor")
        if monitor is not None:
            monitor.close()
        super().destroy()

    def _apply_step(self):
        """The engine's optimizer step; then the optimizer object the caller passed to
        initialize() counts as stepped. DeepSpeed's engine runs that object's step() inside its
        own, and a torch LR scheduler made over the object checks it did: the scheduler wraps
        the object's step() to set _opt_called, and warns at its first step() ("Detected call of
        `lr_scheduler.step()` before `optimizer.step()`") when that is unset. zinf's engine
        applies the update itself, so it sets the flag the wrapper would have set."""
        try:
            super()._apply_step()
        finally:
            # The train_loss of the next step starts afresh, as DeepSpeed's _take_model_step
            # resets its sum.
            self._monitor_losses = None
        client = getattr(self, "client_optimizer", None)
        if client is not None:
            client._opt_called = True

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False):
        """At stage 3 without stage3_gather_16bit_weights_on_model_save the Trainer saves a
        checkpoint by calling save_checkpoint(output_dir) twice (from save_model, then for the
        optimizer). DeepSpeed writes the tag twice; the second call, where nothing the checkpoint
        holds changed since the first (no forward, backward, step, parameter write, checkpoint
        load, learning rate set, or in-place change of a frozen parameter or buffer:
        ZinfEngine._saved_state_key), would write the same state again (zinf replaces a tag
        saved again), so it is skipped."""
        resolved_tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        # Skipped only when nothing the checkpoint holds can have changed since the last save
        # (before 2026-12-06 a change without a step between, a GatheredParameters write or a
        # checkpoint load, was left out of the second save).
        key = (os.path.abspath(save_dir), resolved_tag, self._saved_state_key(),
               bool(save_latest), bool(exclude_frozen_parameters))
        if getattr(self, "_compat_last_save", None) == key and not client_state:
            return True
        saved = super().save_checkpoint(save_dir, tag=tag, client_state=client_state,
                                        save_latest=save_latest,
                                        exclude_frozen_parameters=exclude_frozen_parameters)
        if self.global_rank == 0:
            _write_recovery_script(save_dir)
        self._compat_last_save = key
        return saved


def _write_recovery_script(save_dir: str):
    """DeepSpeed's engine copies its zero_to_fp32.py into the checkpoint directory (rank 0, at
    each save), so that `python zero_to_fp32.py . out_dir` run there writes the consolidated
    fp32 weights offline. zinf's equivalent is the module zinf.zero_to_fp32 (the same command
    line, over zinf.torch.get_fp32_state_dict_from_zero_checkpoint; it needs the zinf package).
    Written under a temporary name, synced and renamed, so that the directory holds the whole
    script or the previous one; executable, as DeepSpeed's."""
    source = pathlib.Path(__file__).with_name("zero_to_fp32.py").read_bytes()
    target = os.path.join(save_dir, "zero_to_fp32.py")
    temporary = os.path.join(save_dir, ".zero_to_fp32.py.tmp")
    with open(temporary, "wb") as f:
        f.write(source)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(temporary, 0o755)
    os.replace(temporary, target)
    directory = os.open(save_dir, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


# ---- deepspeed.initialize ------------------------------------------------------------------------

def _clean_config(config: dict) -> dict:
    """The config as the Trainer and Accelerate filled it, in the form zinf.torch reads:
    Accelerate sets steps_per_print to float("inf") (not JSON) to silence DeepSpeed's logging;
    and a config without a ZeRO stage gets DeepSpeed's default, 0."""
    steps = config.get("steps_per_print")
    if isinstance(steps, float) and math.isinf(steps):
        config["steps_per_print"] = 2**31 - 1
    # DeepSpeed's ZeRO stage when the config names none is 0 (no partitioning:
    # DeepSpeedZeroConfig.stage), where zinf's engine defaults to 3. A script written for
    # DeepSpeed then expects whole parameters in engine.module outside the forward (its
    # state_dict() saved with torch.save, an EMA copy, a norm over model.parameters()), which
    # stage 3 would leave as empty placeholders: the stage is DeepSpeed's 0, which zinf runs as
    # stage 1 (the same steps, the optimizer state partitioned).
    zero = config.get("zero_optimization")
    if zero is None:
        config["zero_optimization"] = {"stage": 0}
    elif isinstance(zero, dict) and "stage" not in zero:
        # A parameter offload without a stage ran at zinf's stage 3 before the default became
        # DeepSpeed's; refused here rather than by the engine, whose refusal would name a stage
        # the config does not hold.
        section = zero.get("offload_param")
        device = section.get("device", "none") if isinstance(section, dict) else "none"
        switch = next((key for key in ("cpu_offload_param", "cpu_offload_params")
                       if zero.get(key)), None)
        if device not in (None, "none") or switch is not None:
            asked = (f'offload_param.device "{device}"' if switch is None else
                     f"{switch}: {zero[switch]}")
            raise ValueError(
                f"deepspeed.initialize (zinf.deepspeed_compat): zero_optimization.{asked} asks "
                "to offload the parameters, but the config names no ZeRO stage, and DeepSpeed's "
                "default, 0, ignores that section: add \"stage\": 3 to zero_optimization")
        zero["stage"] = 0
    tensor_parallel = config.get("tensor_parallel") or {}
    if int(tensor_parallel.get("autotp_size", 1) or 1) > 1:
        tp_model_init(None, tensor_parallel["autotp_size"], None)
    return config


def _optimizer_section(optimizer: torch.optim.Optimizer) -> tuple[dict, list[dict]]:
    """A torch optimizer object (the Trainer's create_optimizer(), or Accelerate's
    DeepSpeedCPUAdam made from it) as the config's "optimizer" section and zinf parameter
    groups: the section takes lr and weight_decay from the optimizer's defaults and betas and eps
    from its first group; each group keeps its own lr and weight_decay, in the same order (a
    scheduler over the object sets them by position; a group's "initial_lr", which a torch
    scheduler records, is kept, and its "lr" is the next step's).

    torch's Adam adds weight_decay to the gradient (L2), as DeepSpeedCPUAdam(adamw_mode=False)
    does: where a group decays, the section is "Adam" with adam_w_mode false (the config's
    "Adam" is AdamW without it); where none does, the two are the same and it is "AdamW".
    torch's AdamW, Adam(decoupled_weight_decay=True) and DeepSpeedCPUAdam (adamw_mode=True, its
    default) decay decoupled: "AdamW". torch's Adagrad is "Adagrad" with its eps and lr_decay; a
    non-zero initial_accumulator_value, which the engine does not take (its state sum starts at
    0), is refused naming it. DeepSpeedCPUAdagrad is "Adagrad" with the lr, eps and weight_decay
    its groups hold, as DeepSpeed's update reads them: a torch Adagrad's lr_decay and
    initial_accumulator_value left in groups Accelerate passed on are not applied (a warning
    names them), and amsgrad is ignored."""
    defaults = optimizer.defaults
    groups = [g for g in optimizer.param_groups if g["params"]]
    first = groups[0] if groups else defaults

    def values(key, default, of=None):
        """The values the groups (those of `of`, default every group) hold for `key`."""
        return {g.get(key, defaults.get(key, default))
                for g in ((groups or [defaults]) if of is None else of)}

    # The type is checked first, so that an optimizer zinf does not map is refused by its name
    # and not by one of its options (SGD's nesterov, say), which would suggest the rest maps.
    # DeepSpeedCPUAdagrad reads only lr, eps and weight_decay from its groups (and ignores
    # amsgrad); groups Accelerate passed on from a torch Adagrad still hold torch's lr_decay and
    # initial_accumulator_value, which DeepSpeed's update does not apply.
    deepspeed_adagrad = isinstance(optimizer, DeepSpeedCPUAdagrad)
    adagrad = deepspeed_adagrad or isinstance(optimizer, torch.optim.Adagrad)
    # Before torch 2.7 AdamW was no subclass of Adam: name both.
    adam = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, DeepSpeedCPUAdam))
    if not (adagrad or adam):
        raise NotImplementedError(
            f"deepspeed.initialize (zinf.deepspeed_compat): the optimizer "
            f"{type(optimizer).__name__} has no zinf equivalent (torch's AdamW, Adam and "
            "Adagrad, DeepSpeedCPUAdam, FusedAdam and DeepSpeedCPUAdagrad are mapped); give the "
            "config an \"optimizer\" section instead")
    for option in ("amsgrad", "maximize", "nesterov", "foreach_only"):
        if option == "amsgrad" and deepspeed_adagrad:
            continue
        if any(values(option, False)):
            # Named where it was set: the optimizer (every group inherits it), or a group.
            where = ("the optimizer's" if defaults.get(option) else
                     "parameter group " + next(str(i) for i, g in enumerate(optimizer.param_groups)
                                               if g["params"] and g.get(option)) + "'s")
            raise NotImplementedError(f"deepspeed.initialize (zinf.deepspeed_compat): {where} "
                                      f"{option}=True has no zinf equivalent")
    lr_decays = {0.0}
    if deepspeed_adagrad:
        kind = "Adagrad"
        unread = sorted({f"{key}={v}" for key in ("lr_decay", "initial_accumulator_value")
                         for v in values(key, 0.0) if v})
        if unread:
            logger.warning("deepspeed.initialize (zinf.deepspeed_compat): DeepSpeedCPUAdagrad's "
                           f"groups hold {', '.join(unread)}, which its update does not apply "
                           "(as DeepSpeed's); it trains with lr, eps and weight_decay only")
    elif adagrad:
        kind = "Adagrad"
        initial = [v for v in values("initial_accumulator_value", 0.0) if v]
        if initial:
            raise NotImplementedError(
                "deepspeed.initialize (zinf.deepspeed_compat): the Adagrad optimizer's "
                f"initial_accumulator_value={initial[0]} has no zinf equivalent (the engine's "
                "state sum starts at 0); use 0")
        lr_decays = values("lr_decay", 0.0)
        if len(lr_decays) > 1:
            raise NotImplementedError(
                "deepspeed.initialize (zinf.deepspeed_compat): the Adagrad optimizer's groups "
                f"have different lr_decay values {sorted(lr_decays)}; the engine takes one")
    else:
        decaying = [g for g in groups if g.get("weight_decay", defaults.get("weight_decay", 0))]
        if isinstance(optimizer, torch.optim.AdamW):
            decoupled = {True}
        elif isinstance(optimizer, DeepSpeedCPUAdam):
            decoupled = {bool(optimizer.adamw_mode)}
        else:
            decoupled = {bool(v) for v in values("decoupled_weight_decay", False, decaying)}
        if len(decoupled) > 1:
            raise NotImplementedError(
                "deepspeed.initialize (zinf.deepspeed_compat): the Adam optimizer's groups mix "
                "decoupled_weight_decay True and False; the engine decays every group one way")
        kind = "Adam" if decaying and decoupled == {False} else "AdamW"
    params = {"lr": float(defaults["lr"]), "weight_decay": float(defaults.get("weight_decay", 0))}
    if not adagrad:
        params["betas"] = [float(b) for b in first.get("betas", (0.9, 0.999))]
    params["eps"] = float(first.get("eps", 1e-10 if adagrad else 1e-8))
    if adagrad and float(next(iter(lr_decays))):
        params["lr_decay"] = float(next(iter(lr_decays)))
    if kind == "Adam":
        params["adam_w_mode"] = False
    # A group's lr is the rate of the next step: a torch scheduler made over the optimizer set
    # it already (to 0 at the start of a warm-up from 0), and keeps the base lr as "initial_lr",
    # which zinf.torch scales the group by.
    zinf_groups = [{"params": list(g["params"]), "lr": float(g["lr"]),
                    **({"initial_lr": float(g["initial_lr"])} if "initial_lr" in g else {}),
                    "weight_decay": float(g.get("weight_decay", params["weight_decay"])),
                    "eps": float(g.get("eps", params["eps"])),
                    **({} if adagrad else {"betas": tuple(g.get("betas", params["betas"]))})}
                   for g in groups]
    return {"type": kind, "params": params}, zinf_groups


def _record_shapes(engine: DeepSpeedEngine):
    """At stage 3 a parameter is an empty tensor outside its module's forward; DeepSpeed marks
    its full shape as ds_shape and ds_numel, which the Trainer's parameter count reads."""
    if engine.stage < 3:
        return
    for param in engine.module.parameters():
        shape = engine._shapes.get(id(param))
        if shape is not None:
            param.ds_shape = torch.Size(shape)
            param.ds_numel = math.prod(shape)


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, distributed_port=29500, mpu=None, dist_init_required=None,
               collate_fn=None, config=None, mesh_param=None, config_params=None):
    """deepspeed.initialize, as Accelerate's prepare() calls it: zinf.torch.initialize with the
    Trainer's optimizer object, when there is one, turned into the config's "optimizer" section
    (a config with both is refused). Returns (engine, optimizer, dataloader, lr_scheduler) with
    the engine a DeepSpeedEngine."""
    if model is None:
        raise ValueError("deepspeed.initialize: model is required")
    if mpu is not None or mesh_param is not None:
        raise NotImplementedError("deepspeed.initialize (zinf.deepspeed_compat): model "
                                  "parallelism (mpu, mesh_param; Ulysses sequence parallelism "
                                  "passes one) is not supported")
    # Frozen parameters (PEFT, LoRA and other adapters) go to zinf.torch, which keeps them as
    # module tensors at stages 1 and 2 and refuses them at stage 3, naming the first.
    config = _zt._config_argument(config, config_params, args)
    if dist_init_required is not False:
        init_distributed(distributed_port=distributed_port)
    _refuse_without_launcher("deepspeed.initialize")
    if torch.distributed.is_initialized():
        _check_world("initialize")
    _check_accelerate_processes()
    config = _clean_config(_zt._read_config(config))
    _monitor.check_config(config, _comm_get_rank())
    client_optimizer = None
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise NotImplementedError("deepspeed.initialize (zinf.deepspeed_compat): an "
                                      "optimizer callable is not supported; pass an optimizer "
                                      "object or a config \"optimizer\" section")
        if "optimizer" in config:
            raise ValueError("deepspeed.initialize: an optimizer object and a config "
                             "\"optimizer\" section were both given; pass one")
        config["optimizer"], model_parameters = _optimizer_section(optimizer)
        client_optimizer = optimizer
    engine, zinf_optimizer, loader, scheduler = _zt.initialize(
        model=model, config=config, model_parameters=model_parameters,
        lr_scheduler=lr_scheduler, training_data=training_data, collate_fn=collate_fn)
    engine.__class__ = DeepSpeedEngine
    engine._compat_training_dataloader = loader
    try:
        with engine._aborting_on_error("deepspeed.initialize: the monitors"):
            engine.monitor = _monitor.MonitorMaster(config, engine.global_rank)
    except BaseException:
        # Rank 0 could not make its monitors' directory or writer: the engine goes, and with
        # several ranks the others' next collective fails naming this rank.
        engine.destroy()
        raise
    engine._monitor_initial_scale = engine.loss_scale
    engine._monitor_scale_moved = False
    _remember_parameters(engine)
    if (engine.global_rank, engine.world_size) != (_comm_get_rank(), _comm_get_world_size()):
        # The engine's communicator and torch.distributed's group were formed from different
        # launchers' ranks (a group the script made itself, say, on other ranks).
        raise NotImplementedError(
            f"deepspeed.initialize (zinf.deepspeed_compat): the engine is rank "
            f"{engine.global_rank} of {engine.world_size}, but torch.distributed rank "
            f"{_comm_get_rank()} of {_comm_get_world_size()}; launch with torchrun, Open MPI's "
            "mpirun, an MPI with Hydra's PMI_RANK and PMI_SIZE, or srun --mpi=pmix, and let "
            "deepspeed.init_distributed() form the group from the launcher")
    _record_shapes(engine)
    if client_optimizer is not None:
        # A scheduler the caller made over its own optimizer object then moves the engine's
        # groups (the same groups, in the same order).
        client_optimizer.param_groups = zinf_optimizer.param_groups
    # DeepSpeedEngine.client_optimizer: the optimizer object given to initialize(), None when
    # none was (the config's section made the optimizer), as DeepSpeed's engine keeps it.
    engine.client_optimizer = client_optimizer
    return engine, zinf_optimizer, loader, scheduler


# ---- the modules under DeepSpeed's names ---------------------------------------------------------

# DeepSpeed's deepspeed.utils.tensor_fragment functions, which deepspeed.utils exports too.
_TENSOR_FRAGMENT = {
    "safe_get_full_fp32_param": safe_get_full_fp32_param,
    "safe_set_full_fp32_param": safe_set_full_fp32_param,
    "safe_get_full_grad": safe_get_full_grad, "safe_set_full_grad": safe_set_full_grad,
    "safe_get_full_optimizer_state": safe_get_full_optimizer_state,
    "safe_set_full_optimizer_state": safe_set_full_optimizer_state,
}

# Each module install() registers, with its attributes. The packages among them (those with
# submodules) get a __path__, so that an import of a submodule not listed here reaches the
# finder, which refuses it by name. Submodules become attributes of their parent on registration.
_MODULES: dict[str, dict] = {
    "deepspeed": {
        "__version__": VERSION,
        "__version_major__": 0, "__version_minor__": 18, "__version_patch__": 0,
        "__git_hash__": "zinf", "__git_branch__": "zinf",
        "initialize": initialize,
        "init_distributed": init_distributed,
        "add_config_arguments": _zt.add_config_arguments,
        "DeepSpeedEngine": DeepSpeedEngine,
        "tp_model_init": tp_model_init,
    },
    "deepspeed.comm": {
        "init_distributed": init_distributed, "is_initialized": _comm_is_initialized,
        "is_available": lambda: True, "get_rank": _comm_get_rank,
        "get_world_size": _comm_get_world_size, "get_local_rank": _comm_get_local_rank,
        "barrier": _comm_barrier, "all_reduce": _comm_all_reduce, "broadcast": _comm_broadcast,
        "all_gather": _comm_all_gather, "reduce": _comm_reduce,
        "all_gather_into_tensor": _comm_all_gather_into_tensor,
        "reduce_scatter_tensor": _comm_reduce_scatter_tensor,
        "get_global_rank": _comm_get_global_rank, "new_group": _comm_new_group,
        "send": _comm_send, "recv": _comm_recv, "isend": _comm_isend, "irecv": _comm_irecv,
        "ReduceOp": torch.distributed.ReduceOp,
    },
    "deepspeed.accelerator": {"get_accelerator": get_accelerator},
    "deepspeed.zero": {
        "Init": _zt.Init, "GatheredParameters": _zt.GatheredParameters,
        "register_external_parameter": _zt.register_external_parameter,
        "unregister_external_parameter": _zt.unregister_external_parameter,
    },
    "deepspeed.runtime": {},
    "deepspeed.runtime.engine": {"DeepSpeedEngine": DeepSpeedEngine},
    "deepspeed.runtime.dataloader": {"RepeatingLoader": RepeatingLoader},
    "deepspeed.runtime.utils": {"see_memory_usage": see_memory_usage},
    # Accelerate passes a scheduler to initialize() only when its class name is one of these.
    "deepspeed.runtime.lr_schedules": {"VALID_LR_SCHEDULES": [
        "LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]},
    "deepspeed.runtime.zero": {"Init": _zt.Init, "GatheredParameters": _zt.GatheredParameters},
    "deepspeed.runtime.zero.partition_parameters": {
        "Init": _zt.Init, "GatheredParameters": _zt.GatheredParameters,
        "ZeroParamStatus": _zt._torch_init.ZeroParamStatus,
        "_orig_torch_arange": _orig_torch_arange,
        "zero_wrapper_for_fp_tensor_constructor": zero_wrapper_for_fp_tensor_constructor,
    },
    "deepspeed.ops": {},
    "deepspeed.ops.adam": {"DeepSpeedCPUAdam": DeepSpeedCPUAdam, "FusedAdam": FusedAdam},
    "deepspeed.ops.adagrad": {"DeepSpeedCPUAdagrad": DeepSpeedCPUAdagrad},
    "deepspeed.utils": {
        "logger": logger, "log_dist": log_dist, "is_initialized": _comm_is_initialized,
        "set_z3_leaf_modules": set_z3_leaf_modules, "get_z3_leaf_modules": get_z3_leaf_modules,
        "RepeatingLoader": RepeatingLoader, **_TENSOR_FRAGMENT,
    },
    "deepspeed.utils.tensor_fragment": dict(_TENSOR_FRAGMENT),
    "deepspeed.utils.zero_to_fp32": {
        "get_fp32_state_dict_from_zero_checkpoint": _zt.get_fp32_state_dict_from_zero_checkpoint,
        "load_state_dict_from_zero_checkpoint": _zt.load_state_dict_from_zero_checkpoint,
        "convert_zero_checkpoint_to_fp32_state_dict":
            _zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict,
    },
    "deepspeed.checkpoint": {},
    "deepspeed.checkpoint.utils": {"clone_tensors_for_torch_save": clone_tensors_for_torch_save},
}

# Submodules the Trainer path may ask for that stand for features zinf does not have: the
# import fails with this reason rather than as a missing module.
_REFUSED = {
    "deepspeed.runtime.sequence_parallel": "Ulysses sequence parallelism is not supported",
    "deepspeed.utils.groups": "DeepSpeed's process groups (sequence and expert parallelism) do "
                              "not exist over zinf",
    "deepspeed.ops.lion": "DeepSpeedCPULion: give the config an \"optimizer\" section of type "
                          "Lion instead",
}


class _Loader(importlib.abc.Loader):
    """Loads a compat module by handing back the object install() built (a module that was
    removed from sys.modules comes back as the same object)."""

    def create_module(self, spec):
        return _built[spec.name]

    def exec_module(self, module):
        pass


class _Distribution(importlib.metadata.Distribution):
    """importlib.metadata's view of `deepspeed`: its METADATA (name, version) and nothing
    installed on disk. Transformers and Accelerate read metadata("deepspeed") to tell an
    installed package from a stray directory of that name, and version("deepspeed") to gate
    features."""

    def read_text(self, filename):
        if filename == "METADATA":
            return _METADATA
        if filename == "INSTALLER":
            return "zinf.deepspeed_compat\n"
        if filename == "top_level.txt":
            return f"{_DEEPSPEED_NAME}\n"
        return None

    def locate_file(self, path):
        return pathlib.Path(__file__).parent / path


class _Finder(importlib.abc.MetaPathFinder):
    """On sys.meta_path ahead of the others: finds the compat modules under DeepSpeed's names
    (importlib.util.find_spec, a module import after sys.modules lost it), refuses the names
    it does not provide with the reason, and answers importlib.metadata for `deepspeed`."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _DEEPSPEED_NAME and not fullname.startswith(_DEEPSPEED_NAME + "."):
            return None
        if fullname in _built:
            return _built[fullname].__spec__
        for prefix, reason in _REFUSED.items():
            if fullname == prefix or fullname.startswith(prefix + "."):
                raise ModuleNotFoundError(f"{fullname} (zinf.deepspeed_compat): {reason}",
                                          name=fullname)
        raise ModuleNotFoundError(
            f"{fullname}: zinf.deepspeed_compat provides only the DeepSpeed modules that the "
            f"Hugging Face Trainer and Accelerate use ({', '.join(sorted(_built))})",
            name=fullname)

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        name = context.name
        if name is None or re.sub(r"[-_.]+", "_", name).lower() == _DEEPSPEED_NAME:
            yield _Distribution()


_built: dict[str, types.ModuleType] = {}
_finder: _Finder | None = None


def _real_deepspeed() -> str | None:
    """Where a DeepSpeed other than this one would come from: a module already imported, an
    importable package, or an installed distribution; None when there is none."""
    module = sys.modules.get(_DEEPSPEED_NAME)
    if module is not None and module is not _built.get(_DEEPSPEED_NAME):
        return f"the module deepspeed is already imported from {getattr(module, '__file__', '?')}"
    if _finder is None:
        spec = importlib.machinery.PathFinder.find_spec(_DEEPSPEED_NAME)
        if spec is not None:
            return f"a deepspeed package is importable from {spec.origin}"
        try:
            found = importlib.metadata.version(_DEEPSPEED_NAME)
            return f"a deepspeed distribution ({found}) is installed"
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def install(force: bool = False) -> None:
    """Makes `import deepspeed` (and the submodules the Trainer path uses) give this module's
    DeepSpeed API over zinf.torch, and makes importlib.util.find_spec("deepspeed") and
    importlib.metadata.version("deepspeed") answer (VERSION). Call it before transformers or
    accelerate is imported: they decide whether DeepSpeed is available on import. Installing
    twice does nothing.

    Raises RuntimeError when a real DeepSpeed is already imported, importable or installed,
    naming where it is: the compat modules would shadow it. force=True installs them anyway,
    ahead of it (an imported real deepspeed is replaced in sys.modules, which its already
    imported submodules do not follow)."""
    global _finder
    real = _real_deepspeed()
    if real is not None and not force:
        raise RuntimeError(
            f"zinf.deepspeed_compat.install(): {real}; installing the zinf compat modules under "
            "the same name would shadow it. Use a Python environment without DeepSpeed, or "
            "install(force=True) to put zinf's in its place")
    if _finder is not None and sys.modules.get(_DEEPSPEED_NAME) is _built.get(_DEEPSPEED_NAME):
        return
    if force:
        for name in [n for n in sys.modules
                     if n == _DEEPSPEED_NAME or n.startswith(_DEEPSPEED_NAME + ".")]:
            del sys.modules[name]
    if not _built:
        loader = _Loader()
        packages = {name.rsplit(".", 1)[0] for name in _MODULES if "." in name}
        for name, attributes in _MODULES.items():
            is_package = name in packages
            module = types.ModuleType(name, f"DeepSpeed's {name} over zinf.torch "
                                            "(zinf.deepspeed_compat)")
            module.__spec__ = importlib.machinery.ModuleSpec(name, loader, origin=__file__,
                                                             is_package=is_package)
            module.__loader__ = loader
            module.__file__ = __file__
            if is_package:
                module.__path__ = []
            module.__dict__.update(attributes)
            _built[name] = module
        for name, module in _built.items():
            if "." in name:
                parent, child = name.rsplit(".", 1)
                setattr(_built[parent], child, module)
    # Accelerate initialises torch.distributed itself on the CPU (TrainingArguments(use_cpu=True))
    # when TrainingArguments is made, from RANK, WORLD_SIZE and MASTER_ADDR: set them now.
    _launcher_environment("zinf.deepspeed_compat.install()")
    if _finder is None:
        _finder = _Finder()
        sys.meta_path.insert(0, _finder)
    sys.modules.update(_built)
