"""zinf.torch: train a torch.nn.Module with zinf's engine, in DeepSpeed's call shape.

    engine, optimizer, _, _ = zinf.torch.initialize(model=model, config=config,
                                                   model_parameters=model.parameters())
    for batch in batches:
        loss = engine(batch)          # forward
        engine.backward(loss)         # gradients handed to the engine as autograd makes them
        engine.step()                 # the optimizer, at each gradient-accumulation boundary

How the model's tensors meet the engine (docs/PYTHON.md):
- Every nn.Module that owns parameters directly is one engine module, named by its qualified
  name ("transformer.h.0.attn.c_attn"; "(root)" for the model itself). A parameter shared by
  several modules (tied embeddings) belongs to the first module that owns it; the others gather
  that module when they run.
- Parameters' `.data` are torch tensors over the engine's own memory, made by torch.from_dlpack
  without a copy. At stages 1 and 2 they stay for the engine's life. At stage 3 a module's
  parameters are gathered by a forward pre-hook and released by a forward hook, after which each
  parameter's `.data` is an empty placeholder of its dtype; the module's backward gathers them
  again (an autograd function on the module's outputs), and releases them once autograd has
  accumulated the gradients of every parameter the module uses. Tensors that autograd saves for
  the backward and that view a gathered parameter (Linear saves weight.t()) are saved as
  (parameter, size, stride, offset) and rebuilt over the re-gathered memory, so nothing keeps
  released memory alive or reads it.
- Each parameter's gradient is handed to the engine from register_post_accumulate_grad_hook: when
  every parameter of an engine module has its gradient, reduce_gradients() copies them into the
  engine's buckets and the gradients are dropped (param.grad = None), so gradient memory is freed
  as it is handed over. Parameters that got no gradient in a backward are reduced as zeros at the
  end of engine.backward().
- The engine records the order of the gathers on the first step and prefetches in that order
  afterwards (stage3_prefetch_bucket_size, stage3_max_live_parameters), as in C++.
- Frozen parameters (requires_grad False at initialize()). At stages 1 and 2 the engine does not
  know them: each is a module tensor of the compute dtype that every rank keeps whole (as
  DeepSpeed's ZeRO-1/2 keeps it), rank 0's values copied to every rank at initialize() (as
  DeepSpeed's engine broadcasts them), used by forward and backward as it is; it has no gradient,
  no optimizer state and no share of the gradient norm. Checkpoints keep them in the client
  state; state dicts hold them. At stage 3 they are engine parameters registered frozen
  (ParameterSpec::trainable false): partitioned, gathered and released, checkpointed as the
  others, never reduced or changed by a step. A module whose own parameters mix frozen and
  trainable ones puts its frozen ones in an engine module of their own ("<module>#frozen"),
  gathered with the other for its forward and backward. A module that uses frozen parameters
  gives back its backward's gather once autograd has computed the gradients of its inputs (and
  its trainable parameters have theirs), not at the end of the backward.
- Under mpirun each process is one rank (MpiComm), and under torchrun too (the binding's torch
  communicator over a gloo group, python/src/torch_comm.hpp); an exception in forward, backward
  or step aborts the communicator, so the other ranks fail at once naming this one.
- Init (zinf/_torch_init.py) stages parameters as modules are built; the engine's initializers
  read each rank's partition from there.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import copy
import hashlib
import io
import itertools
import json
import math
import os
import sys
import tempfile
import time
import types
import warnings
import weakref
from typing import Any, Iterable

import torch
from torch import nn

from . import _offload, _torch_init, _zinf
from ._gathered import GatheredParameters, engine_of
from ._offload import checkpoint, offload_saved_tensors
from ._torch_init import Init

__all__ = ["initialize", "Init", "GatheredParameters", "ZinfEngine", "ZinfOptimizer",
           "ConfigLRScheduler", "Error", "checkpoint", "offload_saved_tensors",
           "export_safetensors", "add_config_arguments", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint", "init_distributed", "zero"]

Error = _zinf.Error

def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """DeepSpeed's deepspeed.zero.register_external_parameter: at ZeRO stage 3 each module's
    forward gathers the parameters it owns; a parameter of another module that `module`'s
    forward uses directly (a tied weight read as `self.embed.weight` in a parent's forward) must
    be registered so that it is gathered there too. Call it in the module's __init__, before
    initialize(), or after; below stage 3 it changes nothing."""
    externals = module.__dict__.setdefault("_zinf_external_params", [])
    if not any(p is parameter for p in externals):
        externals.append(parameter)
    engine = engine_of(parameter)
    if engine is not None:
        engine._use_external(module, parameter)


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """DeepSpeed's: undoes register_external_parameter()."""
    externals = module.__dict__.get("_zinf_external_params", [])
    module.__dict__["_zinf_external_params"] = [p for p in externals if p is not parameter]
    engine = engine_of(parameter)
    if engine is not None and engine._owner.get(id(parameter)) is not None:
        engine._drop_external(module, parameter)


# deepspeed.zero's names, for scripts that write deepspeed.zero.Init,
# deepspeed.zero.GatheredParameters and deepspeed.zero.register_external_parameter.
zero = types.SimpleNamespace(Init=Init, GatheredParameters=GatheredParameters,
                             register_external_parameter=register_external_parameter,
                             unregister_external_parameter=unregister_external_parameter)

_ROOT_MODULE = "(root)"
# In the engine's error for an fp16 overflow with the loss scale already at its floor
# (lib/engine/engine.cpp, skipped()): the one step() error zinf.torch lets training go on after.
_FLOOR_OVERFLOW = "with the loss scale already at fp16.min_loss_scale"
# Words of torch's errors for a tensor of the wrong shape, as an empty (released) parameter
# gives: such an error at stage 3 gets a note on register_external_parameter().
_SHAPE_WORDS = ("size", "shape", "dimension", "matrix", "mat1", "mat2", "elements", "numel")
_TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
# The most bytes of frozen parameters initialize() broadcasts at once (stages 1 and 2, several
# ranks): few collectives for many small tensors, and no more than this held twice.
_FROZEN_BUCKET_BYTES = 64 << 20


def _load_config_text(text: str, path: str) -> dict:
    """A config file's JSON as DeepSpeed's reader takes it: comments and trailing commas are
    read (hjson), and a key given twice in one object is refused, naming it and the file."""
    class _Duplicate(Exception):
        pass

    def refuse_duplicates(pairs):
        seen = {}
        for key, value in pairs:
            if key in seen:
                raise _Duplicate(key)
            seen[key] = value
        return seen

    stripped = _zinf.strip_config_comments(text)
    try:
        return json.loads(stripped, object_pairs_hook=refuse_duplicates)
    except _Duplicate as duplicate:
        # The engine's reader names the key by its dotted path ("zero_optimization.stage: given
        # twice in one object ...").
        try:
            _zinf.normalize_config(stripped)
        except _zinf.Error as error:
            raise ValueError(f"config {path}: {error}") from None
        raise ValueError(f"config {path}: key '{duplicate}' given twice in one object, which "
                         "DeepSpeed refuses") from None


def _config_argument(config, config_params, args):
    """initialize()'s config: config=, or DeepSpeed's other name for it, config_params=, or
    args.deepspeed_config (add_config_arguments' --deepspeed_config). A config in args and in a
    keyword is refused, as DeepSpeed refuses it, and so is none at all."""
    keyword = "config"
    if config is None:
        config, keyword = config_params, "config_params"
    from_args = getattr(args, "deepspeed_config", None)
    if from_args is not None:
        if config is not None:
            raise ValueError(f"initialize: a config in args.deepspeed_config ({from_args}) and "
                             f"{keyword}= were both given (DeepSpeed refuses this too); pass one")
        config = from_args
    if config is None:
        raise ValueError("initialize: no config: pass config= (a dict or a JSON path) or args "
                         "with --deepspeed_config (zinf.torch.add_config_arguments(parser))")
    return config


def _read_config(config: dict | str | os.PathLike) -> dict:
    """A DeepSpeed-style config from a dict (copied) or the path of a JSON file."""
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            loaded = _load_config_text(f.read(), os.fspath(config))
        if not isinstance(loaded, dict):
            raise TypeError(f"config: {os.fspath(config)} holds a JSON {type(loaded).__name__}, "
                            "not an object")
        return loaded
    if isinstance(config, dict):
        return copy.deepcopy(config)
    raise TypeError(f"config: expected a dict or the path of a JSON file, got {type(config)}")


# _read_latest's answer for a `latest` that exists but cannot be read as text.
_UNREADABLE_LATEST = object()


def _read_latest(path: str):
    """The content of a checkpoint directory's `latest` file, None where there is none, or
    _UNREADABLE_LATEST (never an exception: it runs on rank 0 alone, before a collective save
    the other ranks are already waiting in)."""
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError):
        return _UNREADABLE_LATEST


def _restore_latest(save_dir: str, previous: str | None):
    """Puts a checkpoint directory's `latest` back to `previous` (its content before a save), or
    removes it where previous is None, as the engine replaces it: a temporary written and
    fsynced, renamed over `latest`, the directory fsynced. At every instant `latest` names the
    saved tag (complete) or holds its previous content."""
    latest = os.path.join(save_dir, "latest")
    if previous is None:
        os.unlink(latest)
    else:
        # Not the engine's temporary (`latest.tmp`): this runs outside the engine's lock on the
        # directory, beside which another process's save may be writing its own.
        temporary = f"{latest}.tmp.{os.getpid()}"
        with open(temporary, "w") as f:
            f.write(previous)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, latest)
    directory = os.open(save_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _base_lr(group: dict) -> float:
    """A torch parameter group's base learning rate: its "initial_lr", which torch's LR schedulers
    record when they are made over the group (and then set "lr" to their first step's rate, 0 in
    a warm-up from 0), else its "lr"."""
    return float(group.get("initial_lr", group["lr"]))


def _compute_dtype(config: dict) -> str:
    """The dtype the model computes in, from the engine's resolved config (where DeepSpeed's old
    name of the bf16 section, "bfloat16", is already read as "bf16")."""
    if config.get("bf16", {}).get("enabled", False):
        return "bf16"
    if config.get("fp16", {}).get("enabled", False):
        return "f16"
    return "f32"


class _SavedParameterView:
    """What autograd keeps, at stage 3, of a saved tensor that views a gathered parameter."""

    __slots__ = ("param", "name", "size", "stride", "offset")

    def __init__(self, param, name, tensor):
        self.param = param
        self.name = name
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.offset = tensor.storage_offset()


def _load_tensors(kind: str, kinds: str, own: dict, saved: dict, path: str, warn_missing: bool):
    """Copies the checkpoint's `saved` tensors into the model's `own` ones of the same names
    (converted to their dtypes), for load_checkpoint('path'); refuses a shape that differs,
    naming the tensor, and warns of names on one side only (the model's, with warn_missing)."""
    for name, tensor in own.items():
        if name in saved and saved[name].shape != tensor.shape:
            raise ValueError(f"load_checkpoint('{path}'): {kind} '{name}' has shape "
                             f"{tuple(saved[name].shape)} in the checkpoint but "
                             f"{tuple(tensor.shape)} in the model")
    with torch.no_grad():
        for name, tensor in own.items():
            if name in saved:
                tensor.copy_(saved[name])
    missing = sorted(set(own) - set(saved)) if warn_missing else []
    unexpected = sorted(set(saved) - set(own))
    if missing or unexpected:
        warnings.warn(
            f"load_checkpoint('{path}'): " + "; ".join(
                part for part in (
                    missing and f"the model's {kinds} {missing[:5]} are not in the checkpoint "
                    "and keep their values",
                    unexpected and f"the checkpoint's {kinds} {unexpected[:5]} are not the "
                    f"model's {kinds} and were not loaded") if part),
            stacklevel=4)


def _saved(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as torch.save should get it: itself where it owns its storage, else a copy
    (torch.save writes a view's whole storage: a slice of a larger buffer would save all of it)."""
    tensor = tensor.detach()
    whole = (tensor.storage_offset() == 0 and tensor.is_contiguous()
             and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())
    return tensor if whole else tensor.clone()


class _PendingInputs:
    """One forward's wait for _InputGradsDone's backward (ZinfEngine._wrap_inputs): held by the
    autograd graph only, so a graph freed without a backward (a forward whose loss was never
    backpropagated, or that raised) stops being waited for."""
    __slots__ = ("__weakref__",)


class _InputGradsDone(torch.autograd.Function):
    """Identity on the inputs of a module that uses frozen parameters (stage 3); its backward
    runs once autograd has computed the gradients of those inputs, the module's backward being
    over then, so that the module's gather for its backward is given back there."""

    @staticmethod
    def forward(ctx, engine, module, token, *tensors):
        ctx.engine = engine
        ctx.module = module
        ctx.token = token
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine._input_grads_done(ctx.module, ctx.token)
        return (None, None, None) + grads


class _GatherForBackward(torch.autograd.Function):
    """Identity on a module's outputs; its backward gathers the module's parameters before
    autograd runs the module's own backward (which needs them)."""

    @staticmethod
    def forward(ctx, engine, module, *tensors):
        ctx.engine = engine
        ctx.module = module
        # New tensor objects over the same memory (and version counter), so that in-place
        # changes of the outputs are still checked by autograd.
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine._gather_for_backward(ctx.module)
        return (None, None) + grads


def _map_tensors(value, fn):
    """Applies fn to the list of tensors found in value (a tensor, or tuples, lists and dicts of
    them), and returns value with each replaced by fn's result, in the same order."""
    # Module-level helpers, not nested recursive functions: a nested function that calls itself
    # is a reference cycle (the function, its closure cell), which would hold the tensors found
    # (and their autograd graphs, with the gathers those wait for) until the garbage collector
    # runs, instead of freeing them with the last reference.
    found = []
    _collect_tensors(value, found)
    if not found:
        return value
    return _rebuild_tensors(value, iter(fn(found)))


def _collect_tensors(value, found: list):
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _collect_tensors(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _collect_tensors(item, found)


def _rebuild_tensors(value, replaced, copy_dicts: bool = False):
    """value with each tensor replaced by the next of `replaced`, in _collect_tensors' order:
    tuples (named ones too) and lists are rebuilt; dicts are changed in place (an output such
    as Hugging Face's ModelOutput keeps its type and attributes), or with copy_dicts rebuilt as
    new dicts, leaving the caller's as they were."""
    if isinstance(value, torch.Tensor):
        return next(replaced)
    if isinstance(value, tuple):
        items = [_rebuild_tensors(item, replaced, copy_dicts) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return [_rebuild_tensors(item, replaced, copy_dicts) for item in value]
    if isinstance(value, dict):
        if copy_dicts:
            return {key: _rebuild_tensors(item, replaced, True) for key, item in value.items()}
        for key in list(value.keys()):
            value[key] = _rebuild_tensors(value[key], replaced)
        return value
    return value


def _cast_inputs_half(value):
    """DeepSpeed's engine with fp16.auto_cast casts the forward's positional inputs to fp16
    (engine.py, _cast_inputs_half): here each floating-point tensor, within tuples, lists and
    dicts, which are rebuilt, not changed in place (the walk of _map_tensors, with copy_dicts;
    every container is new, whether it holds a tensor or not). Integer and boolean tensors keep
    their dtype (DeepSpeed's .half() would turn token ids into floats that no embedding
    takes)."""
    found = []
    _collect_tensors(value, found)
    cast = [t.half() if t.is_floating_point() else t for t in found]
    return _rebuild_tensors(value, iter(cast), copy_dicts=True)


_MPI_LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")


def _started_by_torchrun() -> bool:
    """Whether torchrun (torch.distributed.run's elastic agent, which `accelerate launch` runs
    too) started this process: the agent sets TORCHELASTIC_RUN_ID and RANK for every worker. Its
    word wins over an MPI launcher's variables, which the workers inherit from the launcher that
    started torchrun itself (`srun torchrun ...`: each node's torchrun is one srun task, whose
    PMIX_RANK is the node's index and SLURM_STEP_NUM_TASKS the node count)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def _choose_comm(comm: str | None) -> str:
    """"local" (one process), "mpi" (this process's rank of an mpirun/srun job) or "torch" (this
    process's rank of a torchrun job, over a gloo group of torch.distributed). None picks "torch"
    when torchrun started the process with WORLD_SIZE > 1 (TORCHELASTIC_RUN_ID and RANK set,
    whatever launcher started torchrun), else "mpi" when an MPI launcher did
    (OMPI_COMM_WORLD_SIZE, PMI_SIZE, or PMIX_RANK in the environment), else "torch" when
    WORLD_SIZE > 1 and RANK is set, else "local"."""
    if comm is not None:
        if comm not in ("local", "mpi", "torch"):
            raise ValueError(f"comm={comm!r}: not \"local\", \"mpi\" or \"torch\"")
        return comm
    if (not _started_by_torchrun()
            and any(v in os.environ for v in _MPI_LAUNCHER_VARIABLES)):
        return "mpi"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if "RANK" not in os.environ:
            raise NotImplementedError(
                "WORLD_SIZE > 1 without RANK and without an MPI launcher: zinf.torch runs several "
                "processes under torchrun (python -m torch.distributed.run --nproc_per_node N "
                "script.py), which sets RANK, or under mpirun (comm=\"mpi\")")
        return "torch"
    return "local"


class _TorchTransport:
    """The torch communicator's link to torch.distributed (python/src/torch_comm.hpp): a gloo
    process group of zinf's own, so that its collectives never interleave with the script's,
    and the group's store, which carries the abort notices and the barriers. The binding's worker
    thread calls it with the GIL held, one collective at a time in the order the engine issued
    them. The data moves as bytes (uint8 tensors that torch owns: gloo never touches the engine's
    memory); the sums are the binding's, in rank order."""

    def __init__(self, timeout_ms: int):
        import datetime

        import torch.distributed as dist

        if not dist.is_available():
            raise NotImplementedError("comm=\"torch\": this torch has no torch.distributed")
        self._dist = dist
        timeout = datetime.timedelta(milliseconds=timeout_ms)
        if not dist.is_initialized():
            # The script did not initialise torch.distributed: zinf does, from torchrun's
            # environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), and destroys the group at
            # exit.
            global _initialised_torch_distributed
            dist.init_process_group(backend="gloo", init_method="env://", timeout=timeout)
            _initialised_torch_distributed = True
        self._group = dist.new_group(backend="gloo", timeout=timeout)
        self.rank = dist.get_rank(self._group)
        self.world_size = dist.get_world_size(self._group)
        # The group's ranks in the default group's numbering (broadcast names its source so).
        self._global_ranks = [dist.get_global_rank(self._group, r)
                              for r in range(self.world_size)]
        self._store = dist.distributed_c10d._get_default_store()
        self._prefix = f"zinf/{self._group.group_name}"
        self._notice_key = f"{self._prefix}/abort"

    def launch(self, kind: int, send, out_bytes: int, root: int):
        dist = self._dist
        data = torch.from_numpy(send).clone() if send is not None else None
        if kind == 0:
            out = torch.empty(out_bytes, dtype=torch.uint8)
            work = dist.all_gather_into_tensor(out, data, group=self._group, async_op=True)
        elif kind == 1:
            out = torch.empty(out_bytes, dtype=torch.uint8)
            work = dist.all_to_all_single(out, data, group=self._group, async_op=True)
        else:
            out = data if self.rank == root else torch.empty(out_bytes, dtype=torch.uint8)
            work = dist.broadcast(out, src=self._global_ranks[root], group=self._group,
                                  async_op=True)
        return work, out

    @staticmethod
    def wait(work, slice_s: float) -> bool:
        import datetime

        try:
            work.wait(timeout=datetime.timedelta(seconds=slice_s))
            return True
        except RuntimeError:
            if not work.is_completed():
                return False
            # Completed as the slice ran out, or failed: wait() says which.
            work.wait()
            return True

    def notice(self):
        if not self._store.check([self._notice_key]):
            return None
        return self._store.get(self._notice_key).decode("utf-8", "replace")

    def post_notice(self, text: str):
        # The first notice stays: the peers report the rank that failed first.
        self._store.compare_set(self._notice_key, "", text)

    def barrier_arrive(self, generation: int) -> int:
        return self._store.add(f"{self._prefix}/barrier{generation}", 1)

    def barrier_count(self, generation: int) -> int:
        return self._store.add(f"{self._prefix}/barrier{generation}", 0)

    def close(self, healthy: bool):
        # After a failure the group stays: destroying it waits for gloo's operations left behind,
        # which end only at the timeout. For the same reason the default group is then left to
        # the process's exit (_close_open_engines), even when the failed engine was closed
        # before.
        global _transport_failed
        if not healthy:
            _transport_failed = True
        elif self._dist.is_initialized():
            self._dist.destroy_process_group(self._group)


# Whether zinf.torch initialised torch.distributed (a torchrun script that did not): its default
# group is then destroyed at exit, after the engines, unless a torch communicator closed after a
# failure (_transport_failed).
_initialised_torch_distributed = False
_transport_failed = False


def _make_transport(comm: str, config: dict):
    """The torch communicator's transport (comm "torch"), with the config's
    zinf.collective_timeout_ms; None for the other communicators."""
    if comm != "torch":
        return None
    resolved = json.loads(_zinf.normalize_config(json.dumps(config)))
    return _TorchTransport(int(resolved["zinf"]["collective_timeout_ms"]))


def _local_rank() -> int:
    """This process's rank on its machine (DeepSpeed's engine.local_rank), as the launcher
    states it: LOCAL_RANK, Open MPI's OMPI_COMM_WORLD_LOCAL_RANK, MPICH's MPI_LOCALRANKID or
    Slurm's SLURM_LOCALID; 0 when none is set (one process)."""
    for key in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"):
        value = os.environ.get(key, "")
        if value.isdigit():
            return int(value)
    return 0


# How long a rank that aborted its communicator waits before its exception propagates: mpirun
# kills the whole job as soon as one process exits with an error, so the peers need a moment to
# receive the abort notice and report it themselves (which takes milliseconds).
_ABORT_LINGER_S = float(os.environ.get("ZINF_ABORT_LINGER_S", "5"))


def _linger_after_abort():
    time.sleep(_ABORT_LINGER_S)


# Engines not destroyed yet; closed at exit (atexit runs before the interpreter finalises, and
# the C library's exit handlers, MPI_Finalize among them, after it).
_open_engines: "weakref.WeakSet[ZinfEngine]" = weakref.WeakSet()
_engine_serials = itertools.count()


@atexit.register
def _close_open_engines():
    for engine in list(_open_engines):
        engine.destroy()  # a failed torch communicator's close sets _transport_failed
    if (_initialised_torch_distributed and not _transport_failed
            and torch.distributed.is_initialized()):
        torch.distributed.destroy_process_group()


def _abort_on_uncaught_exception(exc_type, exc, traceback):
    """sys.excepthook while an engine of several ranks is open: an exception the script does not
    catch, raised outside the engine's calls (a data error, an assert in the training loop),
    aborts the engines' communicators before the traceback prints, so the other ranks fail at
    once naming this rank and the exception, instead of waiting in their next collective for
    collective_timeout_ms (this process's exit closes its engines, which waits for them too)."""
    aborted = False
    for engine in list(_open_engines):
        if engine.world_size > 1 and engine._core.comm_status() == "ok":
            engine._core.abort(f"rank {engine.global_rank} of {engine.world_size} raised "
                               f"{exc_type.__name__}: {exc}"[:900])
            aborted = True
    _previous_excepthook(exc_type, exc, traceback)
    if aborted:
        _linger_after_abort()


_previous_excepthook = sys.excepthook


def _install_abort_on_uncaught_exception():
    global _previous_excepthook
    if sys.excepthook is not _abort_on_uncaught_exception:
        _previous_excepthook = sys.excepthook
        sys.excepthook = _abort_on_uncaught_exception


class ZinfOptimizer(torch.optim.Optimizer):
    """The optimizer as torch sees it: the parameter groups, whose "lr"s the engine reads before
    each step, so torch's LR schedulers drive it. The update itself runs in the engine."""

    def __init__(self, params, engine: "ZinfEngine", defaults: dict):
        super().__init__(params, defaults)
        self._engine = engine

    def step(self, closure=None):
        """Applies the engine's optimizer step to the gradients reduced since the last one.
        engine.step() calls it at each gradient-accumulation boundary (so torch's schedulers see
        the optimizer step before theirs)."""
        loss = closure() if closure is not None else None
        self._engine._apply_step()
        return loss

    def zero_grad(self, set_to_none: bool = True):
        """Nothing to do: gradients are handed to the engine and dropped during backward."""

    def state_dict(self):
        """Refused: torch's would hold the groups only, without the optimizer state (the moments
        and step counts live in the engine, partitioned over its ranks and tiers), so a checkpoint
        made from it would resume with the moments lost. engine.save_checkpoint() saves them."""
        raise NotImplementedError(
            "zinf optimizer.state_dict(): the optimizer state (its moments and step count) lives "
            "in the zinf engine, not in this object; save it with engine.save_checkpoint(dir) and "
            "restore it with engine.load_checkpoint(dir)")

    def load_state_dict(self, state_dict):
        """Refused: the engine's optimizer state cannot be set from a torch optimizer's dict
        (torch's would take the groups' hyper-parameters and drop the moments without a word);
        engine.load_checkpoint() restores what engine.save_checkpoint() saved."""
        raise NotImplementedError(
            "zinf optimizer.load_state_dict(): the optimizer state (its moments and step count) "
            "lives in the zinf engine, which does not take a torch optimizer's state dict; "
            "restore a checkpoint written by engine.save_checkpoint(dir) with "
            "engine.load_checkpoint(dir)")

    @property
    def loss_scale(self) -> float:
        return self._engine.loss_scale

    cur_scale = loss_scale

    @property
    def overflow(self) -> bool:
        """Whether the last optimizer step was skipped for non-finite gradients (an fp16
        overflow), as DeepSpeed's fp16 optimizers' attribute."""
        report = self._engine.last_step_report
        return bool(report is not None and report.get("skipped"))


class ConfigLRScheduler:
    """The config's "scheduler" section as initialize() returns it (where DeepSpeed returns its
    WarmupLR, WarmupDecayLR, WarmupCosineLR or OneCycle object). The engine runs the schedule
    (include/zinf/schedule.hpp) and advances it after every optimizer step it applies, inside
    engine.step(), as DeepSpeed's engine steps its scheduler; this object reports where the
    schedule is.

    - get_last_lr() and get_lr(): each parameter group's learning rate for the next step, the
      same as engine.get_lr() and the optimizer's param_groups "lr"s.
    - last_batch_iteration: DeepSpeed's count, the section's last_batch_iteration (-1 unless
      given) plus the optimizer steps applied since (a step skipped for an fp16 overflow does
      not count, as in DeepSpeed).
    - step(): does nothing, and warns once. engine.step() has already advanced the schedule;
      with DeepSpeed a second call would advance it twice per optimizer step (a mistake there
      too), and moving it to another iteration is not supported.
    - state_dict() and load_state_dict(): {"last_batch_iteration": n}, as DeepSpeed's.
      engine.save_checkpoint() stores it and engine.load_checkpoint() restores it together with
      the engine's own place in the schedule; load_state_dict() alone cannot move the engine's
      schedule, so it refuses a different iteration."""

    def __init__(self, engine: "ZinfEngine", section: dict):
        self.optimizer = engine.optimizer
        self.type = section.get("type")
        self._engine = weakref.ref(engine)
        # last_batch_iteration less the optimizer steps applied: the section's start, or where a
        # loaded checkpoint puts the count.
        self._offset = int(section.get("params", {}).get("last_batch_iteration", -1))
        self._warned_step = False

    @property
    def last_batch_iteration(self) -> int:
        return self._offset + self._engine()._steps_applied()

    def _restore(self, last_batch_iteration: int):
        """Sets the count where a loaded checkpoint's engine is (its steps already loaded)."""
        self._offset = last_batch_iteration - self._engine()._steps_applied()

    def get_last_lr(self) -> list[float]:
        """Each parameter group's learning rate for the next step."""
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    get_lr = get_last_lr

    def step(self, last_batch_iteration=None):
        """Nothing: engine.step() advances the config's schedule (see the class)."""
        if last_batch_iteration is not None and last_batch_iteration != self.last_batch_iteration:
            raise NotImplementedError(
                f"lr_scheduler.step({last_batch_iteration}): the engine runs the config's "
                f"{self.type} schedule and advances it in engine.step(); moving it to another "
                "iteration is not supported")
        if not self._warned_step:
            self._warned_step = True
            warnings.warn(
                f"lr_scheduler.step(): the config's {self.type} schedule is advanced by "
                "engine.step() after each optimizer step; this call does nothing (with DeepSpeed "
                "it would advance the schedule a second time)", stacklevel=2)

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict):
        if int(state["last_batch_iteration"]) != self.last_batch_iteration:
            raise ValueError(
                f"lr_scheduler.load_state_dict: last_batch_iteration "
                f"{state['last_batch_iteration']} differs from the engine's "
                f"{self.last_batch_iteration}; the engine's schedule is restored with its "
                "checkpoint, by engine.load_checkpoint()")


class ZinfEngine(nn.Module):
    """A model trained by zinf: call it as the model, then backward(loss) and step()."""

    def __init__(self, model: nn.Module, config: dict, model_parameters=None, lr_scheduler=None,
                 device_memory_limit_bytes: int = 0, comm: str | None = None):
        super().__init__()
        self.module = model
        self._config = config
        # DeepSpeed creates the swap directories it is given, silently; so do we. This runs before
        # the engine validates the config, so it skips whatever does not have the expected type
        # and leaves a directory it cannot create: the engine's validation then reports that key
        # (and the directory's creation error) by name.
        for path in _torch_init.nvme_paths(config):
            try:
                os.makedirs(path, exist_ok=True)
            except OSError:
                pass
        # step() applies the optimizer after exactly gradient_accumulation_steps backward calls
        # (1 where the config has none, or the engine's derivation from a numeric
        # train_batch_size, as DeepSpeed's), so the engine may trust the count from the first
        # step on: the key declares it (docs/ENGINE.md "Updates during the backward").
        derives = isinstance(config.get("train_batch_size"), (int, float))
        declared = config if "gradient_accumulation_steps" in config or derives else {
            **config, "gradient_accumulation_steps": 1}
        chosen = _choose_comm(comm)
        self._core = _zinf.Engine(json.dumps(declared), [], device_memory_limit_bytes, chosen,
                                  _make_transport(chosen, declared))
        _open_engines.add(self)
        # Engines are made collectively, in the same order on every rank: this number orders
        # them alike everywhere (GatheredParameters over several engines' parameters).
        self._serial = next(_engine_serials)
        if self._core.world_size > 1:
            _install_abort_on_uncaught_exception()
        self.global_rank = self._core.rank
        self.world_size = self._core.world_size
        resolved = json.loads(self._core.config_json())
        self.stage = int(resolved["zero_optimization"]["stage"])
        # The engine runs stage 0 (no partitioning) as stage 1; zero_optimization_stage() says 0.
        given_zero = config.get("zero_optimization")
        self._stage_given_zero = (isinstance(given_zero, dict) and self.stage == 1
                                  and given_zero.get("stage") == 0)
        self._zero_resolved = resolved["zero_optimization"]
        self._gradient_accumulation_steps = int(resolved["gradient_accumulation_steps"])
        # The engine's own count, fixed at initialize(); set_train_batch_size() may lower the
        # one above (the backward calls per step) below it.
        self._engine_gradient_accumulation_steps = self._gradient_accumulation_steps
        self._micro_batch_size = int(resolved["train_micro_batch_size_per_gpu"])
        self.local_rank = _local_rank()
        self.dtype_name = _compute_dtype(resolved)
        self.dtype = _TORCH_DTYPES[self.dtype_name]
        # fp16.auto_cast: the forward casts its positional inputs to fp16, as DeepSpeed's does.
        fp16_section = config.get("fp16")
        self._auto_cast = self.dtype_name == "f16" and isinstance(fp16_section, dict) and bool(
            fp16_section.get("auto_cast", False))
        self._gradient_clipping = float(resolved.get("gradient_clipping", 0.0))
        self._steps_per_print = int(config.get("steps_per_print", 10))
        # DeepSpeed's counters: optimizer steps taken (skipped ones included), those skipped for
        # an overflow, and the samples of the steps taken (train_batch_size() each).
        self.global_steps = 0
        self.skipped_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        # Counts the calls that may change what a checkpoint holds beside the step counts
        # (forward, which moves buffers such as BatchNorm's statistics; backward; parameter
        # writes; checkpoint loads), for _saved_state_key().
        self._state_changes = 0
        self.last_step_report: dict | None = None
        # engine.backward() ran since the last engine.step() call (the micro-batch in progress
        # is then the one micro_steps counts), and whether that call applied an update.
        self._backward_since_step_call = False
        self._step_applied = False
        # DeepSpeed's set_gradient_accumulation_boundary(): None, or the boundary set; and the
        # micro-batches reduced into the engine since the last optimizer step (while there are
        # any, GatheredParameters refuses writes and no stray backward is reported).
        self._boundary_override: bool | None = None
        self._micro_batches_pending = 0
        # The exception the last optimizer step raised (None once a step applies): until then
        # backward() raises it, as does a step() with nothing to apply (_raise_failed_step).
        self._failed_step: Exception | None = None
        # Whether that step was counted (global_steps moved) before the engine failed.
        self._failed_step_counted = False

        # The optimizer's hyper-parameters as its torch param_groups show them, each only where
        # the optimizer has it, as DeepSpeed's optimizers' groups: Adagrad has no betas, Lion no
        # eps (the resolved config holds exactly the type's params).
        opt_params = resolved["optimizer"]["params"]
        self._optimizer_name = str(resolved["optimizer"].get("type", "AdamW"))
        defaults = {"lr": float(opt_params["lr"]),
                    "weight_decay": float(opt_params.get("weight_decay", 0.0))}
        if "betas" in opt_params:
            defaults["betas"] = tuple(float(b) for b in opt_params["betas"])
        if "eps" in opt_params:
            defaults["eps"] = float(opt_params["eps"])
        groups = self._register(model, model_parameters, defaults)
        with self._aborting_on_error("finalize"), self._hint_frozen_mismatch():
            self._core.finalize()
        staged = [(p, _torch_init.staged(p)) for p in self._params.values()]
        staged = [(param, stage) for param, stage in staged if stage is not None]
        if self.world_size > 1:
            # Changed inside GatheredParameters(modifier_rank=r) before initialize(): each rank
            # staged its own values and the engine took each rank's partition from its own file,
            # so rank r's values are written over them (every rank entered those blocks, so every
            # rank writes the same parameters, in the same order): one batch per modifier rank,
            # each a single write of the named parameters' groups (in runs of neighbouring
            # groups, not the whole partition), the root reading each parameter's staged values
            # only when the write reaches it.
            by_root: dict[int, dict[str, _torch_init.Staged]] = {}
            for param, stage in staged:
                if stage.modifier_rank is not None:
                    by_root.setdefault(stage.modifier_rank, {})[self._names[id(param)]] = stage
            for root, stages in by_root.items():
                self._write_batch(list(stages), lambda name, s=stages: s[name].load(), root)
        for param, stage in staged:
            stage.done()
            del param._zinf_staged
        self._place_parameters()
        self._broadcast_frozen()
        for buffer_owner in model.modules():
            for key, buffer in buffer_owner._buffers.items():
                if buffer is not None and buffer.is_floating_point():
                    buffer_owner._buffers[key] = buffer.to(self.dtype)

        self.optimizer = ZinfOptimizer(groups, self, defaults)
        # The engine runs group i at its one learning rate times lr_scale_i, the group's base lr
        # over the config's (_define_groups; 1 when the config's lr is 0, where every group
        # is the default one), so a scheduler must move every group's lr by the same factor
        # (LambdaLR, StepLR, ... do). A group without parameters for the engine has None.
        self._base_lr = defaults["lr"]
        self._lr_scales = [
            (_base_lr(g) / self._base_lr if self._base_lr != 0 else 1.0) if in_engine else None
            for g, in_engine in zip(self.optimizer.param_groups, self._group_in_engine)]
        self._lr_pushed = self._base_lr
        # With the config's `scheduler` section the engine runs the schedule, and the groups'
        # "lr"s show the rate of the next step, as DeepSpeed's do (the lrs last shown, or None).
        self._lrs_shown: list[float] | None = None
        # DeepSpeed's engine keeps the lr_scheduler argument as given (a scheduler, a callable
        # that makes one from the optimizer, or None), beside the scheduler it runs.
        self.client_lr_scheduler = lr_scheduler
        if "scheduler" in resolved:
            if lr_scheduler is not None:
                raise ValueError(
                    "initialize: the config's \"scheduler\" section "
                    f"({resolved['scheduler'].get('type')}) and an lr_scheduler were both "
                    "given; pass one of them")
            self._show_engine_lr()
            lr_scheduler = ConfigLRScheduler(self, resolved["scheduler"])
        if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            lr_scheduler = lr_scheduler(self.optimizer)
        self.lr_scheduler = lr_scheduler
        # engine.backward() is running; else a gradient the hooks see came from another
        # backward, whose first parameter is kept here until step() or backward() reports it.
        self._in_backward = False
        self._stray_gradient: str | None = None
        self._warned_refrozen = False  # _check_frozen_unchanged() warned once
        # What _check_frozen_unchanged() looks at after each backward: the parameters frozen at
        # initialize() (engine-held or kept as module tensors) and those trainable then.
        self._frozen_at_start = [(self._names[pid], self._params[pid]) for pid in self._no_grad]
        self._frozen_at_start += list(self._frozen.values())
        self._trainable_at_start = [(self._names[pid], param) for pid, param in self._params.items()
                                    if pid not in self._no_grad]
        self._stray_accumulated: set[int] = set()
        self._install_hooks()
        self._install_load_hooks(model)

    def __getattr__(self, name: str):
        """DeepSpeed's engine passes an attribute it does not define through to the model
        (engine.generate(...), engine.save_pretrained(...), engine.gradient_checkpointing_enable(),
        a submodule by name): so does this one. The engine's own attributes, parameters, buffers
        and submodules come first."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = (self.__dict__.get("_modules") or {}).get("module")
            if model is not None:
                try:
                    return getattr(model, name)
                except AttributeError:
                    pass
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'") \
                from None

    # ---- registration -------------------------------------------------------------------------

    def _register(self, model: nn.Module, model_parameters, defaults: dict) -> list[dict]:
        """Registers every parameter of the model that requires grad with the engine (the others
        are frozen: _keep_frozen), and returns the optimizer's parameter groups (torch's form)."""
        # pid -> parameter, its name and the engine module that owns it.
        self._params: dict[int, nn.Parameter] = {}
        self._names: dict[int, str] = {}
        self._owner: dict[int, str] = {}
        self._owned: dict[str, list[nn.Parameter]] = {}  # engine module -> its parameters
        self._uses: dict[nn.Module, list[nn.Parameter]] = {}  # torch module -> params it uses
        self._users: dict[int, list[nn.Module]] = {}  # pid -> torch modules that use it
        # pid -> (first name, parameter) of the frozen parameters: those that do not require
        # grad. At stages 1 and 2 the engine does not know them; they stay module tensors
        # (_keep_frozen).
        self._frozen: dict[int, tuple[str, nn.Parameter]] = {}
        # Stage 3: the frozen parameters are engine parameters registered frozen (in _params
        # too), and the engine modules that own them, which are never reduced.
        self._no_grad: set[int] = set()
        self._frozen_modules: set[str] = set()
        taken = {name or _ROOT_MODULE for name, _ in model.named_modules()}
        for module_name, module in model.named_modules():
            direct = list(module.named_parameters(recurse=False))
            if not direct:
                continue
            engine_module = module_name or _ROOT_MODULE
            # An engine module is all frozen or all trainable: a module whose own parameters mix
            # them gives its frozen ones a module of their own.
            new = [p for _, p in direct if id(p) not in self._params]
            frozen_module = engine_module
            if any(p.requires_grad for p in new) and not all(p.requires_grad for p in new):
                frozen_module = f"{engine_module}#frozen"
                while frozen_module in taken:
                    frozen_module += "#"
                taken.add(frozen_module)
            for param_name, param in direct:
                full_name = f"{module_name}.{param_name}" if module_name else param_name
                if id(param) in self._frozen:
                    continue
                staged = _torch_init.staged(param)
                dtype = staged.dtype if staged is not None else param.dtype
                if self.stage == 3 and not dtype.is_floating_point:
                    # The engine holds every stage-3 parameter as a master of floats in the
                    # compute dtype: an index or a mask would come back as floats.
                    raise NotImplementedError(
                        f"parameter '{full_name}' has dtype {dtype}: ZeRO stage 3 partitions "
                        "every parameter as floating-point values, so it would lose its dtype; "
                        "make it a buffer (module.register_buffer), which the engine leaves "
                        "as it is")
                owner = engine_module
                if id(param) not in self._params and not param.requires_grad:
                    if self.stage < 3:
                        self._keep_frozen(full_name, param)
                        continue
                    self._no_grad.add(id(param))
                    owner = frozen_module
                    self._frozen_modules.add(owner)
                self._uses.setdefault(module, []).append(param)
                self._users.setdefault(id(param), []).append(module)
                if id(param) in self._params:
                    continue  # shared with a module seen before: that one owns it
                self._params[id(param)] = param
                self._names[id(param)] = full_name
                self._owner[id(param)] = owner
                self._owned.setdefault(owner, []).append(param)
        for module in model.modules():
            for param in module.__dict__.get("_zinf_external_params", ()):
                self._use_external(module, param)
        if len(self._params) == len(self._no_grad):
            raise ValueError(f"none of the model's {len(self._frozen) + len(self._no_grad)} "
                             "parameters requires grad: there is nothing to train")
        # pid -> its index in the engine's parameter order (_params' order, fixed from here on):
        # GatheredParameters orders and writes a block's parameters by it, in time linear in the
        # block's parameters, not the model's.
        self._param_ids: list[int] = list(self._params)
        self._position: dict[int, int] = {pid: i for i, pid in enumerate(self._param_ids)}
        groups = self._define_groups(model_parameters, defaults)
        group_of = {id(p): g["_zinf_group"] for g in groups for p in g["params"]}
        self._shapes = {}
        for pid, param in self._params.items():
            param._zinf_engine = weakref.ref(self)
            stage = _torch_init.staged(param)
            if self.stage == 3:
                # DeepSpeed's ds_id, ds_shape, ds_numel and ds_status (_torch_init.ZeroParameter).
                _torch_init.make_zero3(param, stage.shape if stage is not None else param.shape)
            else:
                _torch_init.unmake_zero3(param)
            if stage is not None:
                # Built under Init: the engine reads this rank's elements from the staging file
                # during finalize().
                self._shapes[pid] = stage.shape
                # Compared across ranks at finalize, unless a GatheredParameters block changed it
                # on one rank (its values are written over every rank's after finalize).
                values_hash = stage.values_hash if stage.modifier_rank is None else 0
                self._core.register_parameter(self._names[pid], self._owner[pid],
                                              list(stage.shape), self.dtype_name, None,
                                              stage.initializer, group=group_of.get(pid, ""),
                                              values_hash=values_hash,
                                              trainable=pid not in self._no_grad)
                continue
            self._shapes[pid] = tuple(param.shape)
            values = param.detach().to(device="cpu", dtype=torch.float32).contiguous()
            self._core.register_parameter(self._names[pid], self._owner[pid],
                                          list(param.shape), self.dtype_name, values,
                                          group=group_of.get(pid, ""),
                                          trainable=pid not in self._no_grad)
        # Whether each group has parameters for the engine (the learning-rate scales skip those
        # that have none).
        self._group_in_engine = [g.pop("_zinf_group") is not None for g in groups]
        return groups

    def _keep_frozen(self, name: str, param: nn.Parameter):
        """A parameter that does not require grad, at stage 1 or 2: the engine does not register
        it (no master, no optimizer state, no gradient), and _place_parameters() leaves it a
        module tensor in the compute dtype, as DeepSpeed's ZeRO-1/2 optimizer leaves the
        parameters it does not train. (At stage 3 the engine partitions it as any other,
        registered frozen: _register.)"""
        stage = _torch_init.staged(param)
        if stage is not None and stage.modifier_rank is not None and self.world_size > 1:
            raise NotImplementedError(
                f"parameter '{name}' does not require grad and was changed inside "
                f"GatheredParameters(modifier_rank={stage.modifier_rank}) under Init: the engine "
                "does not hold frozen parameters, so it cannot write that rank's values over the "
                "others'; make the same change on every rank")
        _torch_init.unmake_zero3(param)
        self._frozen[id(param)] = (name, param)

    def _use_external(self, module: nn.Module, param: nn.Parameter):
        """register_external_parameter(): `module`'s forward (and its backward) uses `param`,
        another module's, so the engine module owning it is gathered with `module`'s."""
        if id(param) in self._frozen:
            return  # a module tensor the engine does not gather (stages 1 and 2)
        if id(param) not in self._params:
            raise ValueError(
                f"register_external_parameter({type(module).__name__}, ...): the parameter "
                f"(shape {tuple(param.shape)}) is not one of the model's")
        if getattr(self, "_gather_count", None) and any(self._gather_count.values()):
            # A forward or backward in progress: the module's hooks would release a gather
            # they never took.
            raise RuntimeError(
                f"register_external_parameter({type(module).__name__}, "
                f"'{self._names[id(param)]}'): call it in the module's __init__ or between "
                "steps, not during a forward or backward")
        uses = self._uses.setdefault(module, [])
        if not any(p is param for p in uses):
            uses.append(param)
            self._users.setdefault(id(param), []).append(module)
        if (getattr(self, "_hook_handles", None) is not None and self.stage == 3
                and module not in self._hooked):
            self._hook_module(module)

    def _drop_external(self, module: nn.Module, param: nn.Parameter):
        """unregister_external_parameter(): `module` no longer gathers `param`'s module, unless
        the parameter is its own."""
        if any(own is param for _, own in module.named_parameters(recurse=False)):
            return
        self._uses[module] = [p for p in self._uses.get(module, []) if p is not param]
        self._users[id(param)] = [m for m in self._users.get(id(param), []) if m is not module]

    def _define_groups(self, model_parameters, defaults: dict) -> list[dict]:
        """torch's parameter groups (model_parameters: parameters, or dicts with "params" and
        hyper-parameters) as engine groups. The first group whose hyper-parameters are the
        config's is the engine's default group; every other group is add_param_group(), with
        its weight_decay and lr_scale = its lr / the config's lr, where a group's lr is its
        "initial_lr" when it has one (a torch scheduler made over the groups already set "lr" to
        its first step's rate, which the first step runs at). A group may not change betas
        or eps (the engine's groups have one optimizer). Frozen parameters in the groups are
        dropped from them, as DeepSpeed's ZeRO-1/2 optimizer drops the parameters that do not
        require grad; a parameter that requires grad must be in a group."""
        if model_parameters is None:
            model_parameters = list(self._params.values())
        items = list(model_parameters)
        if items and not isinstance(items[0], dict):
            items = [{"params": items}]
        groups, seen = [], set()
        for index, item in enumerate(items):
            if not isinstance(item, dict):
                raise TypeError("model_parameters: either parameters or parameter groups "
                                "(dicts with \"params\"), not both")
            params = item["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            for key in ("betas", "eps"):
                if key not in item:
                    continue
                value = tuple(item[key]) if key == "betas" else float(item[key])
                if value != defaults.get(key):
                    has = defaults[key] if key in defaults else f"(it has no {key})"
                    raise NotImplementedError(
                        f"parameter group {index}: {key} {item[key]} differs from the "
                        f"optimizer's {has}; groups may change lr and weight_decay")
            if item.get("amsgrad"):
                # The engine's Adam keeps no running maximum of the second moments; the key
                # would otherwise ride along in the group, shown and never applied.
                raise NotImplementedError(
                    f"parameter group {index}: amsgrad {item['amsgrad']} has no zinf "
                    "equivalent (AMSGrad is not implemented, as the config's "
                    "optimizer.params.amsgrad true is refused); leave it out or set it False")
            group = {**defaults, **{k: v for k, v in item.items() if k != "params"}}
            for position, p in enumerate(params):
                if id(p) not in self._params and id(p) not in self._frozen:
                    what = (f"shape {tuple(p.shape)}" if isinstance(p, torch.Tensor)
                            else f"a {type(p).__name__}")
                    raise ValueError(f"parameter group {index}: its parameter {position} "
                                     f"({what}) is not one of the model's")
            params = [p for p in params if id(p) not in self._frozen and id(p) not in self._no_grad]
            group["params"] = params
            for p in params:
                if id(p) in seen:
                    raise ValueError(f"parameter group {index}: parameter "
                                     f"'{self._names[id(p)]}' is in more than one group")
                seen.add(id(p))
            groups.append(group)
        missing = [self._names[pid] for pid in self._params
                   if pid not in seen and pid not in self._no_grad]
        if missing:
            raise NotImplementedError(
                f"model_parameters leaves out {len(missing)} of the model's parameters "
                f"({missing[:3]}) that require grad: every parameter that requires grad is "
                "trained; freeze one with requires_grad_(False) before initialize()")
        default_taken = False
        for index, group in enumerate(groups):
            if not group["params"]:
                group["_zinf_group"] = None  # only frozen parameters: nothing for the engine
                continue
            base_lr = _base_lr(group)
            same = (base_lr == defaults["lr"]
                    and float(group["weight_decay"]) == defaults["weight_decay"])
            if same and not default_taken:
                group["_zinf_group"] = ""
                default_taken = True
                continue
            name = f"group{index}"
            if defaults["lr"] == 0:
                raise NotImplementedError(f"parameter group {index}: its own lr needs a non-zero "
                                          "optimizer lr in the config (groups scale it)")
            self._core.add_param_group(name, float(group["weight_decay"]),
                                       base_lr / defaults["lr"])
            group["_zinf_group"] = name
        return groups

    def _place_parameters(self):
        """Points every parameter at the engine's copy (stages 1, 2) or at an empty placeholder
        (stage 3, where a module's parameters exist only while it is gathered). Frozen parameters
        (stages 1 and 2) become tensors on the engine's device, of the compute dtype where they
        are floating-point (others keep theirs), owned by the module: a copy where their dtype or
        device differs, their staged values if they were built under Init."""
        for param in (param for _, param in self._frozen.values()):
            # Only floating-point values take the compute dtype: an integer or boolean
            # parameter (an index, a mask) keeps its dtype, as module.half() and bfloat16(),
            # which DeepSpeed's engine calls, convert only floating-point parameters.
            stage = _torch_init.staged(param)
            if stage is not None:
                values = stage.load()
                param.data = values.to(self.dtype) if values.is_floating_point() else values
                stage.done()
                del param._zinf_staged
            else:
                dtype = self.dtype if param.is_floating_point() else param.dtype
                if param.dtype != dtype or param.device != self.device:
                    param.data = param.data.to(device=self.device, dtype=dtype)
        if self.stage < 3:
            self._refresh_views()
            return
        for param in self._params.values():
            param.data = torch.empty(0, dtype=self.dtype)

    def _broadcast_frozen(self):
        """Stages 1 and 2 with several ranks: rank 0's frozen parameters (in the compute dtype,
        as _place_parameters() left them) are copied over every rank's, as DeepSpeed's engine
        broadcasts the module's parameters from rank 0 at initialize (_broadcast_model), so
        ranks that built or loaded the frozen weights differently (another seed on each rank)
        train one model. (The engine holds the trainable ones, compared across ranks at
        finalize; at stage 3 it holds the frozen ones too.) The ranks first exchange a digest
        of the frozen parameters' names, shapes and dtypes, so that every rank raises the same
        error when they differ; then the parameters are broadcast in order over the engine's
        communicator (MPI, the torch group or the local one), within
        zinf.collective_timeout_ms: consecutive ones packed into buckets of up to
        _FROZEN_BUCKET_BYTES, one broadcast each (a model's many small frozen tensors, norms and
        biases, would otherwise cost a collective each), a parameter larger than a bucket alone
        and in place. A failed broadcast names the parameters it carried."""
        if self.world_size == 1 or self.stage == 3 or not self._frozen:
            return
        frozen = list(self._frozen.values())
        layout = hashlib.blake2b(digest_size=16)
        for name, param in frozen:
            layout.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
        digest = torch.frombuffer(bytearray(layout.digest()), dtype=torch.uint8)
        digests = torch.empty(self.world_size, digest.numel(), dtype=torch.uint8)
        self._core.all_gather_bytes(digest, digests, "initialize: comparing the frozen parameters")
        differ = [r for r in range(1, self.world_size) if not torch.equal(digests[r], digests[0])]
        if differ:
            raise ValueError(
                f"initialize: the frozen parameters (requires_grad False) of rank {differ[0]} "
                "differ from rank 0's in their names, shapes or dtypes: every rank must build the "
                "same model and freeze the same parameters (zinf.torch copies rank 0's frozen "
                "parameters to every rank)")
        bucket: list[tuple[str, torch.Tensor]] = []
        bucket_bytes = 0
        for name, param in frozen:
            data = param.data
            data_bytes = data.numel() * data.element_size()
            if data_bytes == 0:
                continue
            if bucket and bucket_bytes + data_bytes > _FROZEN_BUCKET_BYTES:
                self._broadcast_bucket(bucket, bucket_bytes)
                bucket, bucket_bytes = [], 0
            bucket.append((name, data))
            bucket_bytes += data_bytes
        if bucket:
            self._broadcast_bucket(bucket, bucket_bytes)

    def _broadcast_bucket(self, bucket: list[tuple[str, torch.Tensor]], bucket_bytes: int):
        """Rank 0's bytes of the tensors in `bucket` (name, tensor) over every rank's, in one
        broadcast: a lone tensor in place (through a contiguous copy where it is not
        contiguous), several through one buffer of their bytes, one after another."""
        names = [name for name, _ in bucket]
        shown = ", ".join(f"'{name}'" for name in names[:8])
        what = (f"initialize: broadcasting frozen parameter {shown}" if len(names) == 1 else
                f"initialize: broadcasting frozen parameters {shown}"
                + (f" and {len(names) - 8} more" if len(names) > 8 else ""))
        if len(bucket) == 1:
            data = bucket[0][1]
            buffer = data if data.is_contiguous() else data.contiguous()
            self._core.broadcast_bytes(buffer.view(-1).view(torch.uint8), 0, what)
            if buffer is not data:
                data.copy_(buffer)
            return
        # Rank 0 packs its bytes and sends them; the others receive them and unpack.
        flat = torch.empty(bucket_bytes, dtype=torch.uint8)
        offset = 0
        for _, data in bucket if self.global_rank == 0 else ():
            data_bytes = data.numel() * data.element_size()
            flat[offset:offset + data_bytes].copy_(data.contiguous().view(-1).view(torch.uint8))
            offset += data_bytes
        self._core.broadcast_bytes(flat, 0, what)
        if self.global_rank == 0:
            return
        offset = 0
        for _, data in bucket:
            data_bytes = data.numel() * data.element_size()
            received = flat[offset:offset + data_bytes]
            if data.is_contiguous():
                data.view(-1).view(torch.uint8).copy_(received)
            else:
                buffer = torch.empty(data.shape, dtype=data.dtype)
                buffer.view(-1).view(torch.uint8).copy_(received)
                data.copy_(buffer)
            offset += data_bytes

    def _install_hooks(self):
        self._gather_count: dict[str, int] = {m: 0 for m in self._owned}
        self._gathered_ptrs: dict[int, tuple[nn.Parameter, str]] = {}
        self._backward_holds: dict[nn.Module, int] = {}
        self._ready: dict[str, list[nn.Parameter]] = {m: [] for m in self._owned}
        self._reduced: set[str] = set()
        self._accumulated: set[int] = set()
        # Stage 3, modules that use frozen parameters: the backwards of their forwards whose
        # inputs' gradients autograd has not computed yet (_InputGradsDone).
        # torch module -> the forwards whose _InputGradsDone backward has not run (their graphs'
        # tokens: a graph freed without a backward drops out).
        self._inputs_pending: dict[nn.Module, weakref.WeakSet] = {}
        self._hook_handles = []
        for pid, param in self._params.items():
            if pid in self._no_grad:
                continue  # no gradient, no hook
            self._hook_handles.append(param.register_post_accumulate_grad_hook(self._grad_ready))
        self._hooked: set[nn.Module] = set()
        if self.stage == 3:
            for module in self._uses:
                self._hook_module(module)

    def _install_load_hooks(self, model: nn.Module):
        """torch's load_state_dict() on the model or any of its modules copies into the
        parameters' tensors, which at stages 1 and 2 are views of the engine's device copy: the
        forward would see the loaded values while the fp32 masters, which the next step updates
        and writes back over the views, kept the old ones. So with one rank the load is written
        through to the masters (_load_started / _load_done); with several, where the write is
        collective and only GatheredParameters(modifier_rank=r) makes it, the load of a
        parameter is refused unless such a block holding it is open; at stage 3, where a
        parameter is an empty placeholder outside its module's forward, it is refused unless the
        parameters are gathered (inside GatheredParameters)."""
        # The module whose load_state_dict() call is in progress (torch starts it at prefix "",
        # its submodules at theirs) and the (parameter, loaded values) to write when it ends.
        self._load_root: nn.Module | None = None
        self._load_writes: list[tuple[nn.Parameter, torch.Tensor]] = []
        # pid -> how many open GatheredParameters(modifier_rank=r) blocks hold the parameter
        # (kept by _gathered.py): their ends write a load's values into the masters, so with
        # several ranks a load of the parameter is let through while one is open.
        self._modifying: dict[int, int] = {}
        for module in model.modules():
            self._hook_handles.append(module.register_load_state_dict_pre_hook(self._load_started))
            self._hook_handles.append(module.register_load_state_dict_post_hook(self._load_done))

    def _load_started(self, module, state_dict, prefix, local_metadata, strict, missing_keys,
                      unexpected_keys, error_msgs):
        """Before a load_state_dict() call copies anything (the hook of the module it was called
        on, at prefix ""): the parameters the engine holds that the dict loads, refused at stage
        3 unless gathered, with assign=True (which would replace the parameters the engine
        trains), between a backward and its step, or at stages 1 and 2 with several ranks outside
        a GatheredParameters(modifier_rank=r) block that holds them; at stages 1 and 2 with one
        rank they are kept, with the dict's values, for _load_done to write."""
        if prefix != "":
            return
        self._load_root, self._load_writes = None, []
        loaded = []
        for name, param in module.named_parameters(remove_duplicate=False):
            value = state_dict.get(name)
            if id(param) not in self._params or not isinstance(value, torch.Tensor):
                continue
            shape = tuple(self._shapes[id(param)])
            if self.stage == 3 and param.numel() != math.prod(shape):
                raise NotImplementedError(
                    f"load_state_dict: parameter '{name}' is partitioned by ZeRO stage 3 (an "
                    "empty placeholder outside its module's forward), so torch cannot copy into "
                    "it; load inside zinf.torch.GatheredParameters(list(model.parameters()), "
                    "modifier_rank=0), whose end writes the loaded values into the engine's fp32 "
                    "masters, or restore with engine.load_checkpoint()")
            if local_metadata.get("assign_to_params_buffers"):
                raise NotImplementedError(
                    f"load_state_dict(assign=True): parameter '{name}' is trained by the zinf "
                    "engine, and assign=True would replace it with a tensor the engine does not "
                    "know; load without assign (the values are written into the engine's fp32 "
                    "masters)")
            if self._micro_batches_pending:
                raise RuntimeError(
                    f"load_state_dict: parameter '{name}': the engine holds gradients reduced "
                    "since the last step, against the present values; load after engine.step() "
                    "and before the next engine.backward()")
            # torch copies a value of the parameter's shape only (another is an error it
            # reports); such values are written, as torch copies them. With several ranks the
            # write would be collective, and a rank may load alone inside
            # GatheredParameters(modifier_rank=r) (whose end writes rank r's values on every
            # rank), so only a single rank's engine writes here; outside such a block the load
            # would change this rank's forward only, and the next step would write the old
            # masters back over it, so it is refused before torch copies anything.
            if self.stage == 3 or tuple(value.shape) != shape:
                continue
            if self.world_size == 1:
                loaded.append((param, value.detach()))
            elif id(param) not in self._modifying:
                raise NotImplementedError(
                    f"load_state_dict: parameter '{name}' is trained by the zinf engine at ZeRO "
                    f"stage {self.stage} on {self.world_size} ranks, and a load outside a "
                    "GatheredParameters(modifier_rank=r) block holding it would change this "
                    "rank's forward only (the next step writes the fp32 masters back over it); "
                    "load inside zinf.torch."
                    "GatheredParameters(list(model.parameters()), modifier_rank=0), whose end "
                    "writes rank 0's values into the masters on every rank (every rank enters "
                    "the block), or restore with engine.load_checkpoint()")
        if loaded:
            self._load_root, self._load_writes = module, loaded

    def _load_done(self, module, incompatible_keys):
        """The end of the load_state_dict() call _load_started saw begin: the loaded values go
        into the engine's fp32 masters (the optimizer moments stay), and the parameters are
        pointed back at the engine's device copy, which the write republishes."""
        if module is not self._load_root:
            return
        writes, self._load_root, self._load_writes = self._load_writes, None, []
        self._write_parameters(writes, 0, [param for param, _ in writes])

    def _hook_module(self, module: nn.Module):
        """Gathers the engine modules `module` uses for its forward (stage 3)."""
        self._hook_handles.append(module.register_forward_pre_hook(self._pre_forward))
        self._hook_handles.append(module.register_forward_hook(self._post_forward))
        if any(id(p) in self._no_grad for p in self._uses[module]):
            self._hook_handles.append(
                module.register_forward_pre_hook(self._wrap_inputs, with_kwargs=True))
        self._hooked.add(module)

    def _wrap_inputs(self, module, args, kwargs):
        """A module that uses frozen parameters: no gradient of those tells when its backward is
        over, so its inputs that require grad pass through _InputGradsDone, whose backward
        (autograd's last step of the module's backward) lets _release_if_done give back the
        backward's gather."""
        if not torch.is_grad_enabled():
            return None
        if self._in_backward and self._inputs_pending.get(module):
            # A checkpoint's recomputation (non-reentrant) in the backward of the forward that
            # is waited for already: its graph is never backpropagated.
            return None
        found = []
        _map_tensors((args, kwargs), lambda ts: found.extend(t.requires_grad for t in ts) or ts)
        if not any(found):
            return None
        token = _PendingInputs()
        self._inputs_pending.setdefault(module, weakref.WeakSet()).add(token)

        def wrap(tensors):
            wanted = [i for i, t in enumerate(tensors) if t.requires_grad]
            wrapped = _InputGradsDone.apply(self, module, token, *[tensors[i] for i in wanted])
            out = list(tensors)
            for i, t in zip(wanted, wrapped):
                out[i] = t
            return out

        return _map_tensors((args, kwargs), wrap)

    # ---- stage 3: gather and release ----------------------------------------------------------

    def _modules_needed(self, module: nn.Module) -> list[str]:
        needed = []
        for param in self._uses[module]:
            owner = self._owner[id(param)]
            if owner not in needed:
                needed.append(owner)
        return needed

    def _acquire(self, engine_module: str):
        count = self._gather_count[engine_module]
        if count == 0:
            self._core.gather(engine_module)
            for param in self._owned[engine_module]:
                name = self._names[id(param)]
                param.data = torch.from_dlpack(self._core.parameter(name))
                self._gathered_ptrs[param.data.untyped_storage().data_ptr()] = (param, name)
        self._gather_count[engine_module] = count + 1

    def _release(self, engine_module: str):
        count = self._gather_count[engine_module] - 1
        assert count >= 0, engine_module
        self._gather_count[engine_module] = count
        if count == 0:
            for param in self._owned[engine_module]:
                self._gathered_ptrs.pop(param.data.untyped_storage().data_ptr(), None)
                param.data = torch.empty(0, dtype=self.dtype)
            self._core.release(engine_module)

    def _pre_forward(self, module, inputs):
        for engine_module in self._modules_needed(module):
            self._acquire(engine_module)

    def _post_forward(self, module, inputs, output):
        if self._in_backward and torch.is_grad_enabled():
            # A recomputation in engine.backward() (an activation checkpoint's): the tensors
            # autograd saves here, the parameters' values among them, go to the checkpoint's own
            # hooks, not to _pack_saved, so they are the gathered buffers themselves. The module
            # stays gathered until its parameters' gradients have accumulated (as a gather for
            # its backward would hold it), not released now for its buffers to be reused.
            self._backward_holds[module] = self._backward_holds.get(module, 0) + 1
            return output
        for engine_module in self._modules_needed(module):
            self._release(engine_module)
        # Whether autograd records this forward decides, not the training flag: a model in
        # eval mode (dropout off) may be trained too, and its backward needs the gather.
        if not torch.is_grad_enabled():
            return output

        def wrap(tensors):
            wanted = [i for i, t in enumerate(tensors) if t.requires_grad]
            if not wanted:
                return tensors
            wrapped = _GatherForBackward.apply(self, module, *[tensors[i] for i in wanted])
            out = list(tensors)
            for i, t in zip(wanted, wrapped):
                out[i] = t
            return out

        return _map_tensors(output, wrap)

    def _gather_for_backward(self, module: nn.Module):
        # Also in a backward engine.backward() did not run (another engine's backward through
        # this model, torch.autograd.grad with respect to inputs): the module's values are needed
        # there too.
        for engine_module in self._modules_needed(module):
            self._acquire(engine_module)
        self._backward_holds[module] = self._backward_holds.get(module, 0) + 1

    def _pack_saved(self, tensor):
        try:
            ptr = tensor.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return tensor
        found = self._gathered_ptrs.get(ptr)
        if found is None:
            # Not a parameter view: the caller's offload_saved_tensors, whose hooks these
            # (inner) ones hide, takes it when one is entered.
            offload = _offload.active_offload()
            return tensor if offload is None else offload._pack(tensor)
        return _SavedParameterView(found[0], found[1], tensor)

    @staticmethod
    def _unpack_saved(saved):
        if not isinstance(saved, _SavedParameterView):
            return _offload._unpack(saved)
        data = saved.param.data
        if data.numel() == 0:
            raise RuntimeError(f"zinf: parameter '{saved.name}' is needed by the backward but "
                               "its module is not gathered")
        return data.as_strided(saved.size, saved.stride, saved.offset)

    # ---- gradients ----------------------------------------------------------------------------

    def _grad_ready(self, param: nn.Parameter):
        pid = id(param)
        if not self._in_backward:
            # A backward engine.backward() did not run (loss.backward(), or another engine's
            # backward through this model): the engine does not take the gradient. It is
            # dropped, and a step() with no engine.backward() since the last step refuses
            # (_refuse_stray_backward).
            if self._stray_gradient is None:
                self._stray_gradient = self._names[pid]
            param.grad = None
            if self.stage == 3:
                self._stray_accumulated.add(pid)
                self._release_backward_holds(pid, self._stray_accumulated)
            return
        if pid in self._accumulated:
            return  # a second accumulation in one backward (retain_graph): reduced at the end
        self._accumulated.add(pid)
        owner = self._owner[pid]
        ready = self._ready[owner]
        ready.append(param)
        if len(ready) == len(self._owned[owner]):
            self._reduce(owner)
        if self.stage == 3:
            self._release_backward_holds(pid, self._accumulated)

    def _release_backward_holds(self, pid: int, accumulated: set):
        """Stage 3: each module using parameter `pid` whose backward is over gives back the
        gathers its backward took (_release_if_done)."""
        for module in self._users[pid]:
            self._release_if_done(module, accumulated)

    def _release_if_done(self, module: nn.Module, accumulated: set):
        """Gives back the gathers `module`'s backward took once its trainable parameters all have
        their gradients (in `accumulated`) and, where it uses frozen parameters, autograd has
        computed the gradients of its inputs (_InputGradsDone)."""
        holds = self._backward_holds.get(module, 0)
        if (holds and not self._inputs_pending.get(module)
                and all(id(p) in accumulated or id(p) in self._no_grad
                        for p in self._uses[module])):
            del self._backward_holds[module]
            for _ in range(holds):
                for engine_module in self._modules_needed(module):
                    self._release(engine_module)

    def _input_grads_done(self, module: nn.Module, token: _PendingInputs):
        pending = self._inputs_pending.get(module)
        if pending is not None:
            pending.discard(token)
            if not pending:
                del self._inputs_pending[module]
        self._release_if_done(module, self._accumulated if self._in_backward
                              else self._stray_accumulated)

    def _reduce(self, engine_module: str):
        names, grads = [], []
        for param in self._owned[engine_module]:
            grad = param.grad
            if grad is None:
                grad = torch.zeros(self._shapes[id(param)], dtype=self.dtype)
            names.append(self._names[id(param)])
            grads.append(grad.detach().contiguous())
        self._core.reduce_gradients(engine_module, names, grads)
        for param in self._owned[engine_module]:
            param.grad = None
        self._ready[engine_module] = []
        self._reduced.add(engine_module)

    @contextlib.contextmanager
    def _hint_frozen_mismatch(self):
        """At stages 1 and 2 the engine holds only the parameters that require grad, so ranks
        that froze different parameters, or a checkpoint saved with another set frozen, show as
        engines with different parameters: such an error says so."""
        try:
            yield
        except _zinf.Error as error:
            text = str(error)
            mismatch = ("registered different parameters" in text
                        or "is not in the checkpoint" in text
                        or "is not registered in this engine" in text)
            if self.stage >= 3 or not mismatch:
                raise
            raise _zinf.Error(
                f"{text} (at ZeRO stages 1 and 2 zinf.torch registers only the parameters that "
                "require grad: a parameter frozen on one rank only, or frozen in the run that "
                "saved the checkpoint and not in this one, or the other way round, makes the "
                "parameters differ)") from None

    def _check_frozen_unchanged(self):
        """The frozen parameters are those that did not require grad at initialize(). One
        unfrozen since (or given a .grad) would never train while autograd fills a gradient
        nothing reduces: refused, naming it. One frozen since is still trained by the engine (a
        zero gradient, but weight decay and its moments still move it): warned, once."""
        for name, param in self._frozen_at_start:
            if param.requires_grad or param.grad is not None:
                param.grad = None
                raise RuntimeError(
                    f"parameter '{name}' was frozen at initialize() and requires grad now: zinf "
                    "registered it frozen (no gradients, no optimizer step); freeze or unfreeze "
                    "parameters before initialize()")
        if self._warned_refrozen:
            return
        for name, param in self._trainable_at_start:
            if not param.requires_grad:
                self._warned_refrozen = True
                warnings.warn(
                    f"parameter '{name}' required grad at initialize() and does not "
                    "now: zinf still steps it (with a zero gradient, which weight decay and its "
                    "optimizer moments still move it by); freeze parameters before "
                    "initialize()", stacklevel=4)
                return

    def _check_no_new_parameters(self):
        """The engine trains the parameters the model had at initialize(). One added to the
        model since, or put in place of one of them (`module.weight = nn.Parameter(...)`), is
        not the engine's: it would get a gradient every backward and never a step. Refused after
        the backward, naming it, where it requires grad or has a .grad (a frozen one added later
        is left alone, as the module tensors frozen at initialize() are)."""
        for name, param in self.module.named_parameters(remove_duplicate=False):
            pid = id(param)
            if pid in self._params or pid in self._frozen:
                continue
            if param.requires_grad or param.grad is not None:
                param.grad = None
                raise RuntimeError(
                    f"parameter '{name}' was added to the model or replaced after initialize(): "
                    "the engine trains the parameters registered at initialize() and would never "
                    "step this one; change the model's parameters before initialize() (new values "
                    "for a registered parameter go in place: inside "
                    "GatheredParameters(modifier_rank=0), or engine.module.load_state_dict(), "
                    "with several ranks inside that block)")

    def _finish_backward(self):
        """Reduces the modules whose parameters autograd did not reach (zeros for those without
        a gradient), and releases what the backward still holds."""
        for engine_module in self._owned:
            if engine_module not in self._reduced and engine_module not in self._frozen_modules:
                self._reduce(engine_module)
        for module, holds in list(self._backward_holds.items()):
            for _ in range(holds):
                for engine_module in self._modules_needed(module):
                    self._release(engine_module)
        self._backward_holds.clear()
        self._inputs_pending.clear()
        self._reduced.clear()
        self._accumulated.clear()
        self._check_frozen_unchanged()
        self._check_no_new_parameters()
        leaked = [m for m, c in self._gather_count.items() if c]
        assert not leaked, f"modules still gathered after backward: {leaked[:3]}"

    # ---- DeepSpeed's call shape ---------------------------------------------------------------

    @contextlib.contextmanager
    def _aborting_on_error(self, what: str):
        """An exception raised here (by the model's code, autograd or the engine) aborts the
        communicator before it propagates: the other ranks' collectives fail at once with an
        error naming this rank, instead of waiting for collective_timeout_ms. A failure that
        came from a peer is passed on as it is."""
        try:
            yield
        except BaseException as error:
            if self.world_size > 1 and self._core.comm_status() == "ok":
                self._core.abort(f"rank {self.global_rank} of {self.world_size} raised "
                                 f"{type(error).__name__} in {what}: {error}"[:900])
                _linger_after_abort()
            raise

    def forward(self, *args, **kwargs):
        self._state_changes += 1
        if self._auto_cast:
            args = _cast_inputs_half(args)
        with self._aborting_on_error("forward"):
            if self.stage < 3:
                return self.module(*args, **kwargs)
            held = dict(self._gather_count)
            # Checkpoints made in this forward (torch.utils.checkpoint non-reentrant, as Hugging
            # Face's gradient_checkpointing_enable() makes them) recompute their whole forward in
            # the backward: stopping early, as they do by default, would skip the post-forward
            # hooks of the modules after the last tensor the backward needs, which then stay
            # gathered.
            with torch.autograd.graph.saved_tensors_hooks(self._pack_saved, self._unpack_saved), \
                    torch.utils.checkpoint.set_checkpoint_early_stop(False):
                try:
                    return self.module(*args, **kwargs)
                except BaseException as error:
                    # The modules whose forward the error cut short keep no gather: the engine
                    # can step, and the next forward gathers afresh.
                    for engine_module, count in held.items():
                        while self._gather_count[engine_module] > count:
                            self._release(engine_module)
                    if isinstance(error, RuntimeError) and any(word in str(error)
                                                               for word in _SHAPE_WORDS):
                        error.add_note(
                            "zinf.torch, ZeRO stage 3: a parameter holds its values only during "
                            "the forward of the module that owns it, and is an empty tensor "
                            "elsewhere; if a module's forward uses another module's parameter "
                            "(a tied weight read as self.<child>.weight), register it there with "
                            "zinf.torch.zero.register_external_parameter(module, parameter), "
                            "as with DeepSpeed")
                    raise

    def backward(self, loss: torch.Tensor, retain_graph: bool = False):
        """Runs autograd on loss times the loss scale; every gradient reaches the engine. Returns
        what DeepSpeed's backward returns: the loss divided by gradient_accumulation_steps (in
        fp32) when that is above 1, else the loss itself. (zinf's engine averages the
        micro-batches at the step instead of scaling each loss, so the division is only for the
        value returned, which a script may log.)"""
        self._run_backward(loss, retain_graph)
        gas = self._gradient_accumulation_steps
        return loss.float() / gas if gas > 1 else loss

    def _run_backward(self, loss: torch.Tensor, retain_graph: bool, loss_factor: int = 1):
        """backward() without its value: autograd on loss x loss_factor (DeepSpeedEngine's
        scale_wrt_gas=False gives gradient_accumulation_steps) x the loss scale, after the
        checks; the micro-batch counts once it succeeded."""
        if self._failed_step is not None:
            # Before the micro-batch count: the failed step left it as it was, and a refusal
            # for "micro-batch N over gradient_accumulation_steps" would hide why.
            self._raise_failed_step("engine.backward()")
        pending, gas = self._micro_batches_pending, self._gradient_accumulation_steps
        if pending >= gas:
            # Refused before autograd runs: the engine keeps the micro-batches it has, and a
            # step() applies them.
            over = (f"engine.backward(): micro-batch {pending + 1} since the last optimizer step, "
                    f"over gradient_accumulation_steps ({gas})")
            if self._boundary_override is None:
                raise NotImplementedError(
                    f"{over}: call engine.step() after each engine.backward() (it applies the "
                    "optimizer once every gradient_accumulation_steps calls), or raise "
                    "gradient_accumulation_steps in the config to the backward passes one step "
                    "takes")
            with self._aborting_on_error("backward"):
                raise NotImplementedError(
                    f"{over}, with the boundary set by set_gradient_accumulation_boundary(): "
                    "DeepSpeed divides every loss by gradient_accumulation_steps, while zinf's "
                    "engine averages the micro-batches of a step, which can equal DeepSpeed's sum "
                    "only up to that many; raise gradient_accumulation_steps in the config to the "
                    "most micro-batches a step takes")
        # Before autograd runs, not with micro_steps after it: a backward that fails partway
        # changed the engine too (_saved_state_key).
        self._state_changes += 1
        scale = self._core.loss_scale
        # Gradients of another backward through this model (dropped) are not this one's concern.
        self._stray_gradient = None
        self._stray_accumulated.clear()
        with self._aborting_on_error("backward"):
            # A rate torch's scheduler (or the caller) set since the last step reaches the engine
            # before the backward: with the overlapped step updating during the backward (no
            # clipping), the step's optimizer pass begins in it.
            self._push_lr()
            self._in_backward = True
            try:
                factored = loss * loss_factor if loss_factor != 1 else loss
                (factored * scale if scale != 1.0 else factored).backward(
                    retain_graph=retain_graph)
                self._finish_backward()
            finally:
                self._in_backward = False
        self.micro_steps += 1
        self._micro_batches_pending += 1
        self._backward_since_step_call = True

    def _raise_failed_step(self, call: str):
        """Raises the error of the last optimizer step again, chained to it, from `call`: a
        failed step leaves its micro-batches in the engine (or, where the engine failed after
        the step was counted, none), and what the caller can do depends on that error. An
        operating error (I/O, a collective, a timeout) is the engine's from then on (every later
        call fails with it); a step refused before anything changed (zinf.Error
        invalid_argument or failed_precondition, or an lr the engine cannot take) applies at the
        next engine.step() once its cause is gone."""
        error = self._failed_step
        pending = self._micro_batches_pending
        held = ("the step was counted, and the engine failed after it: open a new engine and "
                "load a checkpoint" if self._failed_step_counted else
                f"no optimizer step was applied since, and the engine holds that step's "
                f"{pending} micro-batch(es): an operating error (I/O, a collective, a timeout) "
                "stays with the engine, so open a new one and load a checkpoint; a step refused "
                "before anything changed is applied by the next engine.step() once its cause is "
                "gone")
        # The error's own message first, so that a zinf.Error still starts with its code.
        message = (f"{error} -- {call}: raised again, the last engine.step() having raised this "
                   f"{type(error).__name__}; {held}")
        try:
            again = type(error)(message)
        except Exception:
            again = RuntimeError(message)
        # Not inside _aborting_on_error: the failed step aborted the communicator already where
        # its error called for that, and a step refused before anything changed (an lr the
        # engine cannot take) must leave it open, for the step to apply once the cause is gone.
        raise again from error

    def _refuse_stray_backward(self, call: str):
        """Raises at a step when, since the last step, autograd produced gradients of the model's
        parameters only in backward passes engine.backward() did not run (loss.backward() in
        place of engine.backward(loss)): the engine received none, so the step would apply
        nothing. Those gradients were dropped as they came. (A backward of another engine
        through this model, or torch.autograd.grad, beside this engine's own engine.backward()
        calls is no mistake: its gradients are dropped, and nothing is said.)"""
        name = self._stray_gradient
        if name is None or self._micro_batches_pending:
            return
        self._stray_gradient = None
        raise Error(
            f"failed_precondition: {call}: no engine.backward() since the last step, but the "
            f"gradient of parameter '{name}' came from a backward that engine.backward() did not "
            "run (loss.backward()?); call engine.backward(loss) instead of loss.backward(): it "
            "scales the loss and hands every gradient to the engine. That backward's gradients "
            "were dropped")

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the micro-batch in progress ends a gradient accumulation, so that its step()
        applies the optimizer: DeepSpeed's answer, the same from before that micro-batch's
        forward until its step() (after the step it is the next micro-batch's)."""
        if self._boundary_override is not None:
            return self._boundary_override
        in_progress = self.micro_steps + (0 if self._backward_since_step_call else 1)
        return in_progress % self._gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None):
        """DeepSpeed's: from now on is_gradient_accumulation_boundary() returns is_boundary, and
        step() applies the optimizer exactly when it is true (Accelerate sets it before each
        backward; None returns to counting micro-batches). As in DeepSpeed, every micro-batch's
        loss counts 1 / gradient_accumulation_steps, however many micro-batches the step has:
        step() divides the accumulated gradients by that count (Engine::step(average_over)),
        not by the micro-batches reduced. A step of more micro-batches than
        gradient_accumulation_steps is refused at the backward that would pass it
        (NotImplementedError); a boundary set with no backward since the last step applies
        nothing."""
        self._boundary_override = None if is_boundary is None else bool(is_boundary)

    @property
    def device(self) -> torch.device:
        """Where the model computes, for `batch.to(engine.device)`: the CPU (the binding opens a
        HostDevice)."""
        return torch.device("cpu")

    @property
    def dp_world_size(self) -> int:
        """The data-parallel ranks: every rank (zinf has no model or pipeline parallelism)."""
        return self.world_size

    def steps_per_print(self) -> int:
        """The config's steps_per_print (10 unless given); zinf prints nothing itself."""
        return self._steps_per_print

    def zero_optimization_stage(self) -> int:
        """The config's ZeRO stage (DeepSpeed's engine method): 0 where the config says 0 (or,
        through deepspeed.initialize, names no stage: DeepSpeed's default), which the engine runs
        as stage 1 (engine.stage), so that a script's checks for DeepSpeed's stage 0 hold."""
        return 0 if self._stage_given_zero else self.stage

    def zero_optimization(self) -> bool:
        """Whether the config's ZeRO stage is above 0, as DeepSpeed's."""
        return self.zero_optimization_stage() > 0

    def fp16_enabled(self) -> bool:
        return self.dtype_name == "f16"

    def bfloat16_enabled(self) -> bool:
        return self.dtype_name == "bf16"

    def gradient_clipping(self) -> float:
        """The config's gradient_clipping (0: none)."""
        return self._gradient_clipping

    def _offload_section(self, key: str, *deprecated: str):
        """DeepSpeed's zero_config.<key>: the config's section (its resolved values, attributes
        as on DeepSpeed's pydantic object), or None where the config has none (DeepSpeed's
        default); a deprecated switch (cpu_offload, cpu_offload_param, cpu_offload_params) makes
        one with device "cpu", as DeepSpeed's config does."""
        given = self._config.get("zero_optimization", {}) or {}
        if given.get(key) is None and not any(given.get(d) for d in deprecated):
            return None
        return types.SimpleNamespace(**self._zero_resolved[key])

    def zero_offload_optimizer(self):
        """The config's zero_optimization.offload_optimizer (device, nvme_path, pin_memory,
        buffer_count as attributes), or None without the section, as DeepSpeed's."""
        return self._offload_section("offload_optimizer", "cpu_offload")

    def zero_offload_param(self):
        """The config's zero_optimization.offload_param (device, nvme_path, pin_memory,
        buffer_count, buffer_size as attributes), or None without the section, as DeepSpeed's."""
        return self._offload_section("offload_param", "cpu_offload_param", "cpu_offload_params")

    def zero_cpu_offload(self) -> bool:
        """Whether the optimizer state is offloaded to "cpu" (not "nvme"), as DeepSpeed's."""
        section = self.zero_offload_optimizer()
        return section is not None and section.device == "cpu"

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """The config's zero_optimization.stage3_gather_16bit_weights_on_model_save (or one of
        DeepSpeed's other names for it; false unless given), as DeepSpeed's. Accelerate and
        Trainer read it at stage 3: true, they save the consolidated 16-bit state dict; false,
        a ZeRO checkpoint. zinf's save_16bit_model() and _zero3_consolidated_16bit_state_dict()
        gather the weights whatever it says."""
        zero = self._config.get("zero_optimization") or {}
        for key in ("stage3_gather_16bit_weights_on_model_save",
                    "gather_16bit_weights_on_model_save",
                    "stage3_gather_fp16_weights_on_model_save"):
            if key in zero:
                return bool(zero[key])
        return False

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(the dtype the model computes in, the dtype gradients are accumulated in), as
        DeepSpeed's. zinf accumulates in fp32 whatever the model's dtype (data_types.
        grad_accum_dtype may only be "fp32" or null); DeepSpeed's default is the model's."""
        return self.dtype, torch.float32

    def get_mom(self) -> list:
        """Each parameter group's "betas" (0.0 for a group without, as Adagrad's), as DeepSpeed's
        get_mom() for the optimizers other than SGD and RMSprop (zinf has neither)."""
        return [group.get("betas", 0.0) for group in self.optimizer.param_groups]

    def was_step_applied(self) -> bool:
        """Whether the last step() updated the parameters: false after a step() that only
        accumulated, and after one skipped for non-finite gradients (an fp16 overflow), as
        DeepSpeed's."""
        return self._step_applied

    def get_global_grad_norm(self) -> float | None:
        """The global L2 norm of the unscaled, averaged gradients before clipping (StepReport
        grad_norm) of the last optimizer step that was applied, as DeepSpeed's; None before the
        first step. After a step skipped for an fp16 overflow it stays the last applied step's
        (0.0 when none was applied yet), as DeepSpeed's: its ZeRO optimizers (stages 1-3) return
        from step() on an overflow before they compute the norm, and the engine then reads the
        _global_grad_norm the optimizer kept (initially 0.0)."""
        if self.last_step_report is None:
            return None
        return self.__dict__.get("_applied_grad_norm", 0.0)

    def gradient_accumulation_steps(self) -> int:
        """The backward calls per optimizer step (DeepSpeed's engine method)."""
        return self._gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        """The config's micro-batch size: one backward's batch on one rank."""
        return self._micro_batch_size

    def train_batch_size(self) -> int:
        """The samples of one optimizer step over all ranks: micro-batch size x
        gradient_accumulation_steps x world size, as DeepSpeed's."""
        return self._micro_batch_size * self._gradient_accumulation_steps * self.world_size

    def set_train_batch_size(self, train_batch_size: int):
        """DeepSpeed's: one optimizer step takes train_batch_size samples from now on, by a new
        gradient_accumulation_steps (train_batch_size / (micro-batch x world size)); the
        micro-batch stays. ValueError where train_batch_size is not a multiple of micro-batch x
        world size, as DeepSpeed's, or below it.

        The engine fixed the config's gradient_accumulation_steps at initialize(): with
        zinf.overlap_step the step's optimizer pass may begin in the backward of that many-th
        micro-batch ("Updates during the backward" in docs/ENGINE.md), so a count above it is
        refused (NotImplementedError naming the key: give the config the largest count the run
        uses, and lower it here). It is refused too while the engine holds micro-batches of a
        step not yet applied (RuntimeError): their step would end at a count they were not
        divided by. Like DeepSpeed's, the boundaries that follow are counted from micro_steps,
        the backward calls so far: a step ends where micro_steps reaches a multiple of the new
        count."""
        per_step = self._micro_batch_size * self.world_size
        what = f"set_train_batch_size({train_batch_size})"
        if (isinstance(train_batch_size, bool) or int(train_batch_size) != train_batch_size
                or train_batch_size < per_step or train_batch_size % per_step != 0):
            raise ValueError(
                f"{what}: train batch size must be divisible by micro-batch data parallelism, "
                f"a positive multiple of train_micro_batch_size_per_gpu "
                f"({self._micro_batch_size}) x {self.world_size} rank(s) = {per_step}")
        steps = int(train_batch_size) // per_step
        configured = self._engine_gradient_accumulation_steps
        if steps > configured:
            raise NotImplementedError(
                f"{what}: {steps} micro-batches per step, above the config's "
                f"gradient_accumulation_steps ({configured}), which the engine fixed at "
                "initialize(); set gradient_accumulation_steps (or train_batch_size) in the "
                "config to the largest count the run uses and lower it with this call")
        if self._micro_batches_pending:
            raise RuntimeError(
                f"{what}: the engine holds {self._micro_batches_pending} micro-batch(es) of a "
                "step not yet applied, divided by the present gradient_accumulation_steps "
                f"({self._gradient_accumulation_steps}); call it after the engine.step() that "
                "applies them")
        self._gradient_accumulation_steps = steps

    def wall_clock_breakdown(self) -> bool:
        """DeepSpeed's answer to whether the engine times its forward, backward and step and
        prints the breakdown: False. zinf's engine keeps no such timers (the config's
        wall_clock_breakdown is accepted with no effect; engine.counters() and the engine's
        trace give its own figures)."""
        return False

    def step(self, lr_kwargs: dict | None = None):
        """Applies the optimizer when gradient_accumulation_steps micro-batches were reduced since
        the last step (else does nothing, as DeepSpeed's engine.step()), then, unless the step
        was skipped for an overflow, steps the lr_scheduler given to initialize() with
        lr_kwargs as keyword arguments (the config's schedule advances inside the engine)."""
        boundary = (self.micro_steps % self._gradient_accumulation_steps == 0
                    if self._boundary_override is None else self._boundary_override)
        if self._failed_step is not None and (not boundary or self._micro_batches_pending == 0):
            # A step() that would do nothing after a failed step says so (a step() that has
            # micro-batches to apply calls the engine again: it raises its error again, or, where
            # the step was refused and the cause is gone, applies them).
            self._raise_failed_step("engine.step()")
        with self._aborting_on_error("step"):
            self._refuse_stray_backward("step")
        self._step_applied = False
        self._backward_since_step_call = False
        # Nothing to apply off a boundary, or with no backward since the last step.
        if not boundary or self._micro_batches_pending == 0:
            return
        self.optimizer.step()
        skipped = bool(self.last_step_report.get("skipped"))
        self._step_applied = not skipped
        # As DeepSpeed's _take_model_step: a step skipped for an overflow does not move the
        # schedule.
        if self.lr_scheduler is not None and not skipped and not isinstance(
                self.lr_scheduler, ConfigLRScheduler):
            self.lr_scheduler.step(**(lr_kwargs or {}))

    def _persistent_buffers(self):
        """(name, buffer) of the model's buffers that its state_dict() holds (BatchNorm's running
        statistics and counts, say), as DeepSpeed's checkpoint keeps them in the module's."""
        for module_name, module in self.module.named_modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and name not in module._non_persistent_buffers_set:
                    yield (f"{module_name}.{name}" if module_name else name), buffer

    def _load_buffers(self, saved: dict | None, path: str, warn_missing: bool = True):
        """Copies a checkpoint's buffers into the model's (rank 0's, which every rank loads, as
        DeepSpeed's module state is dp rank 0's); a checkpoint written before buffers were saved
        has none."""
        _load_tensors("buffer", "buffers", dict(self._persistent_buffers()), saved or {},
                      path, warn_missing=warn_missing)

    def _load_frozen(self, saved: dict, excluded: bool, path: str):
        """Copies a checkpoint's frozen parameters into the model's (rank 0's values, which every
        rank loads), converted to the compute dtype. With exclude_frozen_parameters=True at the
        save the model's keep their values, unwarned."""
        _load_tensors("frozen parameter", "frozen parameters",
                      {name: param for name, param in self._frozen.values()}, saved, path,
                      warn_missing=not excluded)

    def _steps_applied(self) -> int:
        """The optimizer steps that updated the parameters (DeepSpeed's scheduler count)."""
        return self.global_steps - self.skipped_steps

    def _scheduled_lr(self) -> float:
        """The engine's learning rate for the groups' current lrs: group i runs at the engine's
        lr times its lr_scale_i, so each group's lr / lr_scale_i must be the same rate. A group
        whose lr_scale is 0 (its base lr was 0) can only stay at 0; any lr, 0 included, may
        follow a base lr of 0 in the config (every group's scale is then 1)."""
        rates = []
        for index, (group, scale) in enumerate(zip(self.optimizer.param_groups, self._lr_scales)):
            if scale is None:
                continue
            lr = float(group["lr"])
            if not math.isfinite(lr) or lr < 0:
                raise ValueError(f"parameter group {index}: lr {lr} is not a finite number >= 0")
            if scale == 0:
                if lr != 0:
                    raise NotImplementedError(
                        f"parameter group {index}: lr {lr}, but the group started at lr 0 while "
                        f"the optimizer's is {self._base_lr}; the engine runs each group at a "
                        "fixed ratio to one learning rate, and this group's ratio is 0")
                continue
            rates.append(lr / scale)
        if not rates:
            return self._lr_pushed
        if any(abs(r - rates[0]) > 1e-12 * max(abs(r), abs(rates[0])) for r in rates):
            lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
            raise NotImplementedError(
                f"the parameter groups' learning rates {lrs} changed by different factors "
                "since the start; the engine scales one learning rate per group by a fixed ratio")
        return rates[0]

    def _push_lr(self):
        if self._lrs_shown is None or self.get_lr() != self._lrs_shown:
            # The groups' lrs are torch's (a torch scheduler's, or set by hand): they go to the
            # engine, and replace the config's schedule from here on (Engine::set_learning_rate).
            lr = self._scheduled_lr()
            if lr != self._lr_pushed:
                self._core.set_learning_rate(lr)
                self._lr_pushed = lr

    def _apply_step(self):
        with self._aborting_on_error("step"):
            # optimizer.step() called directly reaches here without engine.step()'s check.
            self._refuse_stray_backward("step")
        pending, steps = self._micro_batches_pending, self.global_steps
        try:
            self._apply_step_unchecked()
        except Exception as error:
            # An overflow at the loss scale's floor is reported, not a failure: the step counted
            # (skipped), and training may go on. A step refused with no micro-batches to apply
            # (optimizer.step() right after engine.step()) and not counted left the engine as it
            # was: nothing is held for the next call, which goes on as if it had not been made.
            floor = isinstance(error, Error) and _FLOOR_OVERFLOW in str(error)
            if floor:
                self._failed_step = None
            elif pending or self.global_steps != steps:
                self._failed_step = error
                self._failed_step_counted = self.global_steps != steps
            raise
        self._failed_step = None

    def _apply_step_unchecked(self):
        self._push_lr()
        at_floor = None
        with self._aborting_on_error("step"):
            # Divided by gradient_accumulation_steps however many micro-batches the step has (a
            # boundary set by hand, or counting resumed after one), as DeepSpeed divides each
            # micro-batch's loss by it.
            try:
                self.last_step_report = self._core.step(self._gradient_accumulation_steps)
            except Error as error:
                if _FLOOR_OVERFLOW not in str(error):
                    raise
                at_floor = error
        # An fp16 overflow with the loss scale at its floor: the engine skipped the step (its
        # micro-batches dropped, the step counted) and reports it, not sticky, on every rank alike
        # (so the communicator is not aborted). The counts follow as for any skipped step, then
        # the error propagates, as DeepSpeed raises there; a caller may catch it and go on.
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        if at_floor is not None or self.last_step_report.get("skipped"):
            self.skipped_steps += 1
        else:
            self._applied_grad_norm = float(self.last_step_report["grad_norm"])
        self._micro_batches_pending = 0
        if at_floor is not None:
            raise at_floor
        if self._lrs_shown is not None:
            self._show_engine_lr()
        self._refresh_views()

    def _show_engine_lr(self):
        """Sets every group's "lr" to the rate the engine runs it at in the next step: the
        engine's learning rate (the schedule's) times the group's ratio to the config's lr; and
        the "betas" of a group that has them to the next step's (OneCycle cycles beta1, as
        DeepSpeed's sets the groups' betas)."""
        lr = self._core.learning_rate
        betas = tuple(self._core.betas)
        for group, scale in zip(self.optimizer.param_groups, self._lr_scales):
            group["lr"] = lr if scale in (None, 1.0) else lr * scale
            if "betas" in group:
                group["betas"] = betas
        self._lrs_shown = self.get_lr()
        self._lr_pushed = lr

    def zero_grad(self, set_to_none: bool = True):
        """DeepSpeed's: every parameter's .grad becomes None. They are None already (each
        gradient is dropped as it is handed to the engine); the engine's accumulated gradients
        stay until the step, as DeepSpeed's partitioned ones do."""
        for param in self._params.values():
            param.grad = None

    def _refresh_views(self, params=None):
        """Stages 1 and 2: points each parameter (or each of `params`, this engine's) at the
        engine's full device copy, which lives as long as the engine (gather and release are
        bookkeeping there, so the views outlast the release). The copy never moves: every group
        is allocated once when the engine is finalized and rewritten in place by a step, a
        write (Engine::write_parameters) or a checkpoint load, so the engine never leaves a view
        stale; a parameter needs this where the script pointed its .data elsewhere (inside
        GatheredParameters, or outside it: `p.data = x`, `model.half()`), or on first use. A
        writing block's end refreshes its own parameters only; step() and load_checkpoint()
        refresh every parameter, to put back the views the script re-pointed outside any block's
        list."""
        if self.stage == 3:
            return
        if params is None:
            owned = self._owned.items()
        else:
            owned = {}
            for param in params:
                owned.setdefault(self._owner[id(param)], []).append(param)
            owned = owned.items()
        for engine_module, members in owned:
            self._core.gather(engine_module)
            for param in members:
                fresh = torch.from_dlpack(self._core.parameter(self._names[id(param)]))
                if (fresh.data_ptr() != param.data.data_ptr() or fresh.shape != param.shape
                        or fresh.stride() != param.stride() or fresh.dtype != param.dtype):
                    param.data = fresh
            self._core.release(engine_module)

    def destroy(self):
        """Frees the engine and its communicator (DeepSpeed's engine.destroy()). The model's
        parameters the engine holds become empty placeholders (at stages 1 and 2 the frozen ones,
        the module's own tensors, keep their values); the engine cannot be used afterwards.
        Called for every engine still open when the interpreter exits, so that an MPI job's
        communicators are closed before MPI is finalised; that includes an engine whose
        initialize() raised (a refused parameter), which has no hooks' state yet."""
        for param in self.__dict__.get("_params", {}).values():
            param.data = torch.empty(0, dtype=self.dtype)
        self.__dict__.get("_gathered_ptrs", {}).clear()
        self._core.close()
        _open_engines.discard(self)

    def get_lr(self) -> list[float]:
        """Each parameter group's learning rate for the next step (with the config's scheduler,
        the schedule's rate, updated by every step)."""
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    @property
    def loss_scale(self) -> float:
        """The scale engine.backward() multiplies the loss by (1 unless fp16 is enabled)."""
        return self._core.loss_scale

    def counters(self) -> dict:
        """The engine's running counters (gathers, prefetches, live elements, bytes moved)."""
        return self._core.counters()

    def memory(self) -> dict:
        """Bytes of this rank's state on each tier."""
        return self._core.memory()

    def _write_parameters(self, writes: list[tuple[nn.Parameter, torch.Tensor]], root: int,
                          block=()):
        """Rank root's values into the masters of the parameters it changed (collective: one
        pass over the groups that hold them), and at stages 1 and 2 the views of the block's
        parameters `block` (this engine's; a rank may have pointed their .data elsewhere)
        refreshed: the engine's device copy does not move, so the write leaves every other view
        where it was (one the script re-pointed outside the block is put back at the next
        step() or load_checkpoint()), and the block's end costs its own parameters, not the
        model's. `writes` holds this
        rank's changed parameters, each with a tensor of its values in any dtype (converted to
        fp32 as the pass reaches it, so that no more than one parameter is held in fp32 besides
        them). With several ranks only root's count, and every rank must call it: root
        broadcasts which of the engine's parameters it changed (how many, then their positions
        in the engine's parameter order, over its communicator: a block end that changed nothing
        costs one broadcast of 8 bytes, however many parameters the engine has) and every rank
        writes those, in the engine's order whatever order the ranks listed them in; the others
        are not touched, so their fp32 masters keep every bit. Nothing changed: nothing is
        written. A parameter root left with another shape is refused before anything is
        written: every rank raises ValueError naming it, and the engine goes on."""
        values = {self._names[id(param)]: tensor for param, tensor in writes}
        # Root's changed parameters in the engine's order, each as its position * 2, + 1 where
        # it was given another shape (refused).
        marks = []
        if self.world_size == 1 or self.global_rank == root:
            marks = sorted({self._position[id(param)] * 2
                            + (tuple(tensor.shape) != tuple(self._shapes[id(param)]))
                            for param, tensor in writes})
        if self.world_size > 1:
            what = f"GatheredParameters: the parameters changed on rank {root}"
            count = torch.tensor([len(marks)], dtype=torch.int64)
            with self._aborting_on_error("GatheredParameters: the parameters changed"):
                self._core.broadcast_bytes(count.view(torch.uint8), root, what)
                received = torch.tensor(marks, dtype=torch.int64) if marks else torch.empty(
                    int(count[0]), dtype=torch.int64)
                if received.numel() > 0:
                    self._core.broadcast_bytes(received.view(torch.uint8), root, what)
            marks = received.tolist()
        changed = [self._param_ids[mark >> 1] for mark in marks]
        reshaped = [self._param_ids[mark >> 1] for mark in marks if mark & 1]
        self._refresh_views(block)  # stages 1 and 2: the block's parameters on the engine's copy
        if reshaped:
            name = self._names[reshaped[0]]
            given = (f" (given {tuple(values[name].shape)})" if name in values else "")
            raise ValueError(
                f"GatheredParameters(modifier_rank={root}): parameter '{name}' of shape "
                f"{tuple(self._shapes[reshaped[0]])} was given another shape on rank {root}"
                f"{given}; a parameter keeps its shape, so nothing was written")
        names = [self._names[pid] for pid in changed]
        if not names:
            return

        def values_of(name):
            return values.pop(name).detach().to(device="cpu", dtype=torch.float32).contiguous()

        self._write_batch(names, values_of, root)

    def _write_batch(self, names: list[str], values_of, root: int):
        """Engine.write_parameters_batch: values_of(name) gives a parameter's fp32 values on
        the root, asked for as the pass reaches it."""
        self._state_changes += 1
        what = f"write_parameters('{names[0]}'" + (
            f" and {len(names) - 1} more)" if len(names) > 1 else ")")
        with self._aborting_on_error(what):
            self._core.write_parameters_batch(names, values_of if self.global_rank == root
                                              else None, root)

    def _saved_state_key(self) -> tuple:
        """What a checkpoint saved now holds besides its directory and options, as cheap marks:
        equal marks at two saves mean nothing the checkpoint holds changed between them. The step
        and micro-batch counts, the calls that change the engine or the model's buffers
        (_state_changes), the learning rates, and torch's version counters of the frozen
        parameters and buffers (bumped by any in-place change of them). micro_steps, which a
        checkpoint holds too, is not needed here: it moves only in backward() and
        load_checkpoint(), which bump _state_changes first (a backward that fails partway counts
        no micro-batch, but the gradients it reduced, or the pass it opened, changed the
        engine)."""
        versions = tuple(t._version for _, t in self._frozen.values())
        versions += tuple(t._version for _, t in self._persistent_buffers())
        return (self.global_steps, self._state_changes, tuple(self.get_lr()), versions)

    def read_parameter(self, name: str) -> torch.Tensor:
        """The fp32 master of a parameter (by its qualified name, or any other name the model
        gives the same parameter: a tied weight's), as a new tensor; for a frozen parameter,
        which has no master, its values (in the compute dtype) converted to fp32."""
        pid = next((pid for pid, n in self._names.items() if n == name), None)
        if pid is None:
            frozen = next((p for n, p in self._frozen.values() if n == name), None)
            if frozen is None:
                # Another name of a parameter the engine knows under its first (the output
                # layer's weight tied to the embedding's).
                alias = dict(self.module.named_parameters(remove_duplicate=False)).get(name)
                if alias is not None and id(alias) in self._params:
                    pid = id(alias)
                    name = self._names[pid]
                elif alias is not None and id(alias) in self._frozen:
                    frozen = alias
                else:
                    raise KeyError(f"no parameter '{name}'")
            if frozen is not None:
                return frozen.detach().to(dtype=torch.float32, copy=True)
        out = torch.empty(self._shapes[pid], dtype=torch.float32)
        self._core.read_parameters(name, out)
        return out

    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Writes <save_dir>/<tag>/ (default tag "global_step<N>") and then <save_dir>/latest, as
        DeepSpeed does. The torch side's state (steps, learning rates, the lr_scheduler's
        state_dict, client_state) travels in the engine's client state, so the whole tag is
        written crash-safely at once: a save cut short leaves `latest` naming the previous one.
        A tag that exists already is replaced, as DeepSpeed writes over it: the new tag is
        written aside and swapped in once complete, so a crash leaves the old tag or the new one.
        save_latest=False leaves `latest` as it was (or absent), as DeepSpeed's: the engine
        names the new tag in `latest`, then rank 0 puts the previous content back (or removes
        the file where there was none), atomically, and every rank waits for it; a crash in
        between leaves `latest` naming the new tag, which is complete. It is refused with
        zinf.keep_last > 0, whose pruning after the save keeps the newest tags and may remove
        the one `latest` names. The frozen
        parameters (stages 1 and 2; the engine does not hold them) travel in the client state
        too, rank 0's, in the compute dtype, under their first names, as DeepSpeed keeps them in
        the module's state; exclude_frozen_parameters=True leaves them out, and
        load_checkpoint() then keeps the model's."""
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        # Only rank 0's client state is written: the model's tensors (buffers, and frozen
        # parameters, which may be most of the model) go into rank 0's alone, serialised from
        # the tensors themselves, and the engine's copy of the blob is dropped after the save.
        keep = self.global_rank == 0
        latest = os.path.join(save_dir, "latest")
        if not save_latest:
            keep_last = json.loads(self._core.config_json()).get("zinf", {}).get("keep_last", 0)
            if keep_last > 0:
                raise NotImplementedError(
                    f"save_checkpoint(save_latest=False) with zinf.keep_last {keep_last}: the "
                    "pruning after a save keeps the newest tags and may remove the one `latest` "
                    "names; save with save_latest=True, or set keep_last 0 (keep every tag)")
            previous = _read_latest(latest) if keep else None
        state = {"global_steps": self.global_steps, "micro_steps": self.micro_steps,
                 "skipped_steps": self.skipped_steps, "global_samples": self.global_samples,
                 "lr": self.get_lr(), "client_state": client_state or {},
                 "buffers": {name: _saved(buffer)
                             for name, buffer in self._persistent_buffers()} if keep else {},
                 "frozen": {} if exclude_frozen_parameters or not keep else {
                     name: _saved(param) for name, param in self._frozen.values()},
                 "frozen_excluded": bool(exclude_frozen_parameters) and bool(self._frozen),
                 "lr_from_schedule": self._lrs_shown is not None
                 and self.get_lr() == self._lrs_shown}
        if self.lr_scheduler is not None and hasattr(self.lr_scheduler, "state_dict"):
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        blob = io.BytesIO()
        torch.save(state, blob)
        del state
        self._core.set_client_state(blob.getvalue())
        del blob
        try:
            self._core.save_checkpoint(save_dir, tag)
        finally:
            self._core.set_client_state(b"")
        if not save_latest:
            failed = None
            if keep and previous is _UNREADABLE_LATEST:
                warnings.warn(f"save_checkpoint('{save_dir}', '{tag}', save_latest=False): "
                              f"'{latest}' could not be read before the save, so it is left "
                              "naming the saved tag", stacklevel=2)
            elif keep and (previous is None or previous.strip() != tag):
                try:
                    _restore_latest(save_dir, previous)
                except OSError as error:
                    failed = error
            if self.world_size > 1:
                # No rank reads `latest` (a load by it) before rank 0 has put it back, and every
                # rank learns whether it could.
                outcome = torch.tensor([failed is not None], dtype=torch.uint8)
                self._core.broadcast_bytes(outcome, 0,
                                           f"save_checkpoint('{save_dir}', '{tag}'): `latest`")
                if failed is None and outcome[0]:
                    failed = OSError(f"rank 0 could not restore '{latest}'")
            if failed is not None:
                raise OSError(f"save_checkpoint('{save_dir}', '{tag}', save_latest=False): the "
                              f"tag is saved, but `latest` names it: {failed}") from failed
        return True

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's save_16bit_model: the module's state_dict (every parameter under each of
        its names, in the dtype the model computes in, and the persistent buffers) written by
        rank 0 with torch.save to <save_dir>/<save_filename>. Collective. At stage 3 the dict is
        _zero3_consolidated_16bit_state_dict()'s, gathered module by module (as DeepSpeed's
        stage3_gather_16bit_weights_on_model_save does, which zinf does not need set); at
        stages 1 and 2 it is the module's state_dict(), frozen parameters included (in the
        compute dtype), unless exclude_frozen_parameters=True leaves out every name of each
        parameter that does not require grad. Returns True."""
        if self.stage == 3:
            state = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        else:
            state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
            if exclude_frozen_parameters:
                for name, param in self.module.named_parameters(remove_duplicate=False):
                    if not param.requires_grad:
                        state.pop(name, None)
        if self.global_rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            torch.save(state, os.path.join(save_dir, save_filename))
        return True

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                             ) -> "collections.OrderedDict | None":
        """DeepSpeed's: the full state dict in the dtype the model computes in, on rank 0 (None
        on the others), for Accelerate's get_state_dict and Trainer's save_model at stage 3.
        Collective: every rank must call it. As DeepSpeed's, it walks the modules as
        nn.Module.state_dict() does (each module's parameters, then its persistent buffers, then
        its children) and gathers one module's parameters at a time (GatheredParameters), so
        besides the dict on rank 0 at most one module is gathered; a parameter shared by several
        modules is the same tensor under each name. Its names are those named_children() and
        named_parameters(recurse=False) reach, as DeepSpeed's: a module or parameter registered
        twice under one parent appears once, and extra state (get_extra_state) and state_dict
        hooks are left out, where state_dict() at stages 1 and 2 has them. ValueError below
        stage 3, as DeepSpeed raises. exclude_frozen_parameters leaves out parameters that do not require grad (at
        stage 3 engine parameters registered frozen)."""
        if self.stage < 3:
            raise ValueError(f"_zero3_consolidated_16bit_state_dict: this function requires "
                             f"ZeRO-3 mode (the config's stage is {self.stage}); use "
                             "engine.module.state_dict()")
        keep = self.global_rank == 0
        state = collections.OrderedDict() if keep else None
        first_name: dict[int, str] = {}
        # A depth-first walk over a stack, in state_dict()'s order, not a nested function calling
        # itself: that would be a reference cycle holding the returned dict until the garbage
        # collector runs, past the caller's last reference.
        pending = [(self.module, "")]
        while pending:
            module, prefix = pending.pop()
            direct = [(n, p) for n, p in module.named_parameters(recurse=False)
                      if not (exclude_frozen_parameters and not p.requires_grad)]
            with GatheredParameters([p for _, p in direct]):
                for name, param in direct if keep else ():
                    key = prefix + name
                    shared = first_name.setdefault(id(param), key)
                    state[key] = state[shared] if shared != key else param.detach().clone()
            for name, buffer in module.named_buffers(recurse=False) if keep else ():
                if name not in module._non_persistent_buffers_set:
                    state[prefix + name] = buffer.detach().clone()
            pending.extend(reversed([(child, prefix + name + ".")
                                     for name, child in module.named_children()]))
        return state

    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None):
        """Loads <load_dir>/<tag> (default: the tag in <load_dir>/latest): the parameters, the
        optimizer state, the step counts and the schedule, all together. Returns (path,
        client_state), or (None, None) with a warning naming the path when there is no latest
        tag, as DeepSpeed does. load_module_strict=False (the Hugging Face Trainer passes it for a
        PEFT model, whose checkpoints it saves with exclude_frozen_parameters=True) loads the same
        and leaves the model's buffers and frozen parameters that the checkpoint lacks as they
        are without a warning; the engine's parameters always load whole. DeepSpeed's options
        that load less (load_module_only=True, load_optimizer_states=False,
        load_lr_scheduler_states=False, custom_load_fn) are refused, naming the way to load the
        weights alone."""
        refused = [(name, value) for name, value, default in [
            ("load_optimizer_states", load_optimizer_states, True),
            ("load_lr_scheduler_states", load_lr_scheduler_states, True),
            ("load_module_only", load_module_only, False),
            ("custom_load_fn", custom_load_fn, None)] if value != default]
        if refused:
            name, value = refused[0]
            raise NotImplementedError(
                f"load_checkpoint({name}={value!r}): a zinf checkpoint "
                "loads as a whole (parameters, optimizer state, steps and schedule). To start "
                "from the weights alone, write them out with zinf.torch.export_safetensors(dir, "
                "out) and load them into the model before initialize(), or into the engine "
                "inside zinf.torch.GatheredParameters(params, modifier_rank=0)")
        if tag is None:
            latest = os.path.join(load_dir, "latest")
            if not os.path.isfile(latest):
                if not os.path.exists(load_dir):
                    why = "the directory does not exist"
                elif not os.path.isdir(load_dir):
                    why = "it is not a directory"
                else:
                    why = f"it has no file 'latest' (save_checkpoint writes {latest})"
                warnings.warn(f"load_checkpoint: nothing loaded from '{load_dir}': {why}; pass "
                              "tag= to load a checkpoint by its tag", stacklevel=2)
                return None, None
            with open(latest) as f:
                tag = f.read().strip()
        path = os.path.join(load_dir, str(tag))
        with self._hint_frozen_mismatch():
            self._state_changes += 1
            self._core.load_checkpoint(load_dir, str(tag))
        state = torch.load(io.BytesIO(self._core.client_state()), weights_only=False)
        self._core.set_client_state(b"")  # read: the engine need not keep the blob
        self._load_buffers(state.get("buffers"), path, warn_missing=bool(load_module_strict))
        self._load_frozen(state.get("frozen", {}),
                          state.get("frozen_excluded", False) or not load_module_strict, path)
        self.global_steps = state["global_steps"]
        # A checkpoint is taken between optimizer steps; the count is moved up to this config's
        # next boundary, so that a run resumed with another gradient_accumulation_steps (two
        # ranks' run resumed on one with twice the accumulation) takes whole steps from the
        # first (DeepSpeed does not keep the count at all, and starts it again from 0).
        gas = self._gradient_accumulation_steps
        self.micro_steps = -(-int(state["micro_steps"]) // gas) * gas
        self.skipped_steps = state.get("skipped_steps", 0)
        self.global_samples = state.get("global_samples",
                                        self.global_steps * self.train_batch_size())
        self._backward_since_step_call = False
        self._step_applied = False
        self._micro_batches_pending = 0
        # A failed step is behind the state loaded: its micro-batches are gone with the state
        # they were reduced into, and the next backward() trains on from the checkpoint.
        self._failed_step = None
        self._failed_step_counted = False
        if self._lrs_shown is not None and state.get("lr_from_schedule", False):
            # The engine's step count came back with the checkpoint: the schedule resumes.
            self._show_engine_lr()
        else:
            for group, lr in zip(self.optimizer.param_groups, state["lr"]):
                group["lr"] = lr
            self._lr_pushed = self._scheduled_lr()
            # Only a rate the engine does not run at already: set_learning_rate() takes the rate
            # from the engine's schedule for good (and with it the updates during the backward).
            if self._lr_pushed != self._core.learning_rate:
                self._core.set_learning_rate(self._lr_pushed)
        if isinstance(self.lr_scheduler, ConfigLRScheduler):
            # The engine's place in the schedule came back with the checkpoint; the count
            # follows it (from the steps taken where the checkpoint does not carry it).
            saved = state.get("lr_scheduler", {}).get("last_batch_iteration")
            if saved is not None:
                self.lr_scheduler._restore(int(saved))
        elif self.lr_scheduler is not None and "lr_scheduler" in state:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self._refresh_views()
        return path, state["client_state"]


def export_safetensors(checkpoint_dir: str, out: str, tag: Any = None,
                       dtype: str = "fp32") -> None:
    """Writes every parameter's full fp32 master of <checkpoint_dir>/<tag> (default: the tag in
    <checkpoint_dir>/latest; saved at any world size) to `out` as safetensors, in "fp32" or
    "bf16", named as the model's parameters (as zero_to_fp32.py does for DeepSpeed). The same as
    `zinf ckpt export`. Frozen parameters are not among them (the engine does not hold them;
    zinf.torch keeps them in the checkpoint's client state):
    get_fp32_state_dict_from_zero_checkpoint() adds them."""
    _zinf.export_checkpoint(str(checkpoint_dir), "" if tag is None else str(tag), str(out), dtype)


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _safetensors_header(f) -> tuple[dict, int]:
    """The JSON header of the safetensors file open as `f` (an 8-byte little-endian header size,
    a JSON header of {name: {dtype, shape, data_offsets}}, then the data), and the offset of its
    data."""
    f.seek(0)
    header_bytes = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(header_bytes))
    header.pop("__metadata__", None)
    return header, 8 + header_bytes


def _tensor_of(data, entry: dict, offset: int = 0) -> torch.Tensor:
    """One tensor of a safetensors header `entry` over `data`, whose byte `offset` is the
    entry's data_offsets origin."""
    dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
    begin, end = entry["data_offsets"]
    count = (end - begin) // dtype.itemsize
    return (torch.frombuffer(data, dtype=dtype, count=count, offset=offset + begin)
            if count else torch.empty(0, dtype=dtype)).reshape(entry["shape"])


def _read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as CPU tensors over one buffer of the file's data, read
    once."""
    with open(path, "rb") as f:
        header, _ = _safetensors_header(f)
        data = bytearray(f.read())
    return {name: _tensor_of(data, entry) for name, entry in header.items()}


class _ExportedWeights:
    """The safetensors file export_safetensors() wrote into a temporary directory, read one
    tensor at a time. The directory is removed when the last _LazyWeight over it goes (this
    object's finalizer calls its cleanup(), so that the TemporaryDirectory's own finalizer, which
    warns ResourceWarning "Implicitly cleaning up", never runs), or at exit."""

    def __init__(self, scratch: tempfile.TemporaryDirectory, path: str):
        self._path = path
        weakref.finalize(self, scratch.cleanup)
        with open(path, "rb") as f:
            self.header, self._data_offset = _safetensors_header(f)

    def read(self, name: str) -> torch.Tensor:
        entry = self.header[name]
        begin, end = entry["data_offsets"]
        with open(self._path, "rb") as f:
            f.seek(self._data_offset + begin)
            data = bytearray(f.read(end - begin))
        return _tensor_of(data, {**entry, "data_offsets": (0, end - begin)})


class _LazyWeight:
    """One weight of get_fp32_state_dict_from_zero_checkpoint(lazy_mode=True), as DeepSpeed's
    lazy-mode GatheredTensor: shape and dtype at once, the CPU tensor (fp32, or a buffer's
    integer dtype) from contiguous(), read then (from the exported file, or converted from the
    frozen parameter or buffer the checkpoint's client state holds), so that one weight at a
    time is in memory."""

    def __init__(self, name: str, shape, read, dtype: torch.dtype = torch.float32):
        self.name = name
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self._read = read

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def contiguous(self) -> torch.Tensor:
        return self._read()

    def __repr__(self) -> str:
        return f"_LazyWeight({self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


def _tag_dir(checkpoint_dir: str, tag: str) -> str:
    """Where the tag's files are, as the C++ readers find them (moved_aside_tag_dir in
    lib/engine/checkpoint_io.cpp): <checkpoint_dir>/<tag>, or <checkpoint_dir>/.<tag>.old where
    a save replacing the tag moved it aside and was cut short before it renamed the new one in
    (no <tag>; .<tag>.old holds the tag's manifest and every file it lists). "" when neither."""
    final = os.path.join(checkpoint_dir, tag)
    if os.path.isdir(final):
        return final
    aside = os.path.join(checkpoint_dir, f".{tag}.old")
    if os.path.lexists(final) or not os.path.isfile(os.path.join(aside, "manifest.json")):
        return ""
    try:
        manifest = _read_manifest(aside)
    except (OSError, ValueError, Error):
        return ""
    files = [entry.get("file") for entry in manifest.get("ranks", [])]
    files += [(entry.get("blocks") or {}).get("file") for entry in manifest.get("ranks", [])]
    files += [entry.get("file") for entry in manifest.get("client_state", [])]
    if manifest.get("tag") != tag or not all(
            os.path.exists(os.path.join(aside, file)) for file in files if file):
        return ""
    return aside


def _read_manifest(tag_dir: str) -> dict:
    """<tag_dir>/manifest.json, its own checksum checked as the C++ reader checks it: the xxh3-64
    of its text with the checksum's 16 digits as zeros. A mismatch is Error naming the file."""
    path = os.path.join(tag_dir, "manifest.json")
    with open(path, "rb") as f:
        text = f.read()
    key = b'"checksum": "'
    at = text.find(key)
    if at < 0 or len(text) - at - len(key) < 16:
        raise Error(f"checkpoint manifest '{path}': no checksum")
    begin = at + len(key)
    stored = text[begin:begin + 16].decode("ascii", "replace")
    computed = f"{_zinf.xxh3_64(text[:begin] + b'0' * 16 + text[begin + 16:]):016x}"
    if stored != computed:
        raise Error(f"checkpoint manifest '{path}' does not match its checksum (xxh3 {computed}, "
                    f"it says {stored}): it changed after the save; restore it from a copy, or "
                    f"read another tag")
    return json.loads(text)


def _checkpoint_tag(checkpoint_dir: str, tag: Any) -> tuple[str, str]:
    """(`tag`, or the tag <checkpoint_dir>/latest names; the directory holding its files, see
    _tag_dir); a missing tag directory is FileNotFoundError naming it (DeepSpeed's ValueError /
    FileNotFoundError)."""
    if tag is None:
        latest = os.path.join(checkpoint_dir, "latest")
        if not os.path.isfile(latest):
            raise ValueError(f"no file 'latest' at {latest}: pass tag= to name the checkpoint")
        with open(latest) as f:
            tag = f.read().strip()
    tag_dir = _tag_dir(checkpoint_dir, str(tag))
    if not tag_dir:
        path = os.path.join(checkpoint_dir, str(tag))
        raise FileNotFoundError(f"the checkpoint directory '{path}' does not exist")
    return str(tag), tag_dir


def _engine_frozen_names(tag_dir: str) -> set[str]:
    """The names of the frozen parameters (requires_grad False at initialize()) that the engine
    holds in the checkpoint at `tag_dir`, and so exports: those of stage 3, which the manifest
    marks "trainable": false (checkpoints written before that field hold none marked, so none
    are named). The frozen parameters of stages 1 and 2 are not the engine's: zinf.torch keeps
    them in the client state, which is read only where they are wanted."""
    if not os.path.isfile(os.path.join(tag_dir, "manifest.json")):
        return set()
    return {p["name"] for p in _read_manifest(tag_dir).get("params", [])
            if p.get("trainable", True) is False}


def _load_client_state(tag_dir: str, mmap: bool) -> dict:
    """The client state zinf.torch saved in the checkpoint at `tag_dir` (frozen parameters of
    stages 1 and 2, persistent buffers), {} where the manifest lists none. Its size and xxh3-64
    are checked against the manifest before torch.load reads it, as load_checkpoint checks them
    (torch.load does not check the zip's CRCs: a flipped bit in a tensor's bytes would load as a
    wrong value). A mismatch is Error naming the file; a listed file that is missing,
    FileNotFoundError naming it."""
    entries = _read_manifest(tag_dir).get("client_state") or []
    if not entries:
        return {}
    entry = entries[0]
    path = os.path.join(tag_dir, entry["file"])
    if not os.path.isfile(path):
        raise FileNotFoundError(f"'{path}', the checkpoint's client state its manifest lists, "
                                f"does not exist: restore it from a copy, or read another tag")
    size_bytes = os.path.getsize(path)
    # The size first: a file of another size is not read to be refused.
    if (size_bytes != int(entry["bytes"])
            or _zinf.xxh3_64_file(path) != (size_bytes, int(entry["xxh3"], 16))):
        raise Error(f"'{path}' does not match its size and checksum in the manifest "
                    f"({entry['bytes']} bytes, xxh3 {entry['xxh3']}; the file has {size_bytes} "
                    f"bytes): it changed after the save; restore it from a copy, or read "
                    f"another tag")
    state = torch.load(path, weights_only=False, mmap=mmap)
    return state if isinstance(state, dict) else {}


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: Any = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, Any]:
    """deepspeed.utils.zero_to_fp32's function: every parameter's full fp32 master of
    <checkpoint_dir>/<tag> (default: the tag in <checkpoint_dir>/latest) as a dict of CPU
    tensors, named as the model's parameters, and the frozen parameters zinf.torch saved in the
    checkpoint's client state (converted to fp32 from the compute dtype they were saved in), as
    DeepSpeed's adds its frozen parameters. exclude_frozen_parameters=True leaves out every
    frozen parameter, those the engine holds at stage 3 too (which its manifest marks); the
    client state is then mapped, not read, so that those left out take no memory. The model's
    persistent buffers (BatchNorm's running statistics, say), which save_checkpoint keeps in
    the client state, are added under their names, as DeepSpeed's adds the buffers of its
    module state, whether or not frozen parameters are excluded: the floating ones in fp32, the
    others (num_batches_tracked) in their own dtype, where DeepSpeed's converts every buffer to
    fp32; a checkpoint written before buffers were saved adds none. A parameter shared by
    several modules (tied embeddings) appears once, under its first owner's name (DeepSpeed's
    names it under each: the checkpoint does not record the other names): load it with
    load_state_dict_from_zero_checkpoint(model, dir), which fills the others in from the model.
    The weights pass through a safetensors file in the system's temporary directory (the
    model's fp32 size). lazy_mode=True returns, as DeepSpeed's, a weight per name that reads
    itself on .contiguous() (shape and dtype at once), so that one weight at a time is in
    memory; the temporary file stays until the last of them is gone. Without it the file is
    read whole and removed before this returns."""
    tag, tag_dir = _checkpoint_tag(checkpoint_dir, tag)
    excluded = _engine_frozen_names(tag_dir) if exclude_frozen_parameters else set()
    scratch = tempfile.TemporaryDirectory(prefix="zinf_fp32_")
    try:
        out = os.path.join(scratch.name, "model.safetensors")
        export_safetensors(checkpoint_dir, out, tag)
        if lazy_mode:
            source = _ExportedWeights(scratch, out)
            weights = {name: _LazyWeight(name, entry["shape"],
                                         lambda name=name: source.read(name))
                       for name, entry in source.header.items() if name not in excluded}
        elif excluded:
            # Only the kept weights read: the frozen ones left out take no memory.
            source = _ExportedWeights(scratch, out)
            weights = {name: source.read(name) for name in source.header if name not in excluded}
        else:
            weights = _read_safetensors(out)
    except BaseException:
        scratch.cleanup()
        raise
    if not lazy_mode:
        scratch.cleanup()
    # Mapped, not read, where the frozen parameters it holds (which may be most of the model)
    # are left out or read one at a time.
    mapped = lazy_mode or exclude_frozen_parameters
    state = _load_client_state(tag_dir, mapped)
    if state:
        extra = dict(state.get("buffers") or {})
        if not exclude_frozen_parameters:
            extra.update(state.get("frozen") or {})
        for name, values in extra.items():
            dtype = torch.float32 if values.is_floating_point() else values.dtype
            weights[name] = (_LazyWeight(name, values.shape,
                                         lambda values=values, dtype=dtype: values.to(dtype),
                                         dtype)
                             if lazy_mode else values.to(dtype, copy=mapped))
    return weights


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str,
                                         tag: Any = None) -> nn.Module:
    """deepspeed.utils.zero_to_fp32's function: loads the checkpoint's fp32 weights into `model`
    (a plain torch model, not one a zinf engine trains) on the CPU and returns it. A parameter
    shared by several modules is loaded under each of its names. The persistent buffers the
    checkpoint holds are loaded too (converted to the model's buffers' dtypes), as DeepSpeed's
    loads them; a buffer it lacks (a checkpoint written before buffers were saved) keeps the
    model's value. A parameter of the model that the checkpoint lacks raises KeyError naming
    it."""
    weights = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    first_name: dict[int, str] = {}
    state = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        source = first_name.setdefault(id(param), name)
        if source not in weights:
            raise KeyError(f"load_state_dict_from_zero_checkpoint: the model's parameter "
                           f"'{source}' is not in the checkpoint {checkpoint_dir}")
        state[name] = weights[source]
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, buffer in module._buffers.items():
            if buffer is None or name in module._non_persistent_buffers_set:
                continue
            full = f"{module_name}.{name}" if module_name else name
            source = first_name.setdefault(id(buffer), full)
            if source in weights:
                state[full] = weights[source]
    model.load_state_dict(state, strict=False)
    return model


def initialize(model: nn.Module, config: dict | str | os.PathLike | None = None,
               model_parameters: Iterable | None = None, optimizer=None, lr_scheduler=None,
               training_data=None, config_params=None, comm: str | None = None, **kwargs):
    """zinf's deepspeed.initialize: returns (engine, optimizer, training_dataloader,
    lr_scheduler).

    model: the torch.nn.Module to train, its parameters on the CPU with their initial values
        (they are copied into the engine, and the model's own copies are released).
    config: a dict or the path of a JSON file with DeepSpeed's keys (docs/ENGINE.md lists them):
        the optimizer comes from its "optimizer" section, the stage and offload from
        "zero_optimization"; "bf16" / "fp16" choose the dtype the model computes in.
    model_parameters: the parameters to train: every parameter of the model that requires grad,
        as parameters or as torch parameter groups (dicts with "params" and their own "lr" and
        "weight_decay"); parameters that do not require grad (frozen) may be given or left out,
        and are not trained (at stage 3 the engine holds them, registered frozen).
    lr_scheduler: a torch LR scheduler over the returned optimizer, or a callable that makes one
        from it; stepped after each optimizer step. Or the config's "scheduler" section (not
        both): the engine runs that schedule, and the optimizer's param_groups "lr"s (and
        engine.get_lr()) show the rate of the next step after each step; the lr_scheduler
        returned is then a ConfigLRScheduler reporting it.
    training_data: a torch Dataset; a DataLoader over it with train_micro_batch_size_per_gpu is
        returned, reading this rank's share of the data in a shuffled order that changes with
        each pass (DeepSpeed's: a DistributedSampler with seed 0).
    args: an argparse namespace; its deepspeed_config (add_config_arguments' --deepspeed_config)
        is the config when config is not given (both are refused, as by DeepSpeed).
    comm: "local" (one process), "mpi" (one rank per process of an mpirun job) or "torch" (one
        rank per process of a torchrun job, over a gloo group of torch.distributed); by default
        "mpi" when an MPI launcher started the process, "torch" when torchrun did (WORLD_SIZE >
        1 and RANK set), else "local".
    """
    config = _config_argument(config, config_params, kwargs.get("args"))
    if optimizer is not None:
        raise NotImplementedError("initialize: pass the optimizer in the config's \"optimizer\" "
                                  "section; a client optimizer object is not supported")
    unknown = set(kwargs) - {"args", "mpu", "dist_init_required", "collate_fn"}
    if unknown:
        raise TypeError(f"initialize: unexpected arguments {sorted(unknown)}")
    config = _read_config(config)
    if training_data is not None and not any(
            key in config for key in ("train_micro_batch_size_per_gpu", "train_batch_size")):
        # The engine runs micro-batches of 1 where the config names no batch size; the loader
        # would read batches of 1 silently, where DeepSpeed refuses the config.
        raise ValueError(
            "initialize(training_data=...): the config gives neither "
            "train_micro_batch_size_per_gpu nor train_batch_size, so the training data loader has "
            "no batch size (DeepSpeed refuses such a config too); give "
            "train_micro_batch_size_per_gpu")
    if not (config.get("optimizer") or {}).get("type"):
        warnings.warn(
            "initialize: the config has no \"optimizer\" section (or no type): zinf trains with "
            "its default, AdamW at torch.optim.AdamW's defaults (lr 1e-3, weight_decay 0.01) and "
            "the section's params; DeepSpeed would make no optimizer of its own. Write the "
            "section to choose", stacklevel=2)
    engine = ZinfEngine(model, config, model_parameters, lr_scheduler, comm=comm)
    loader = None
    if training_data is not None:
        loader = _training_loader(training_data, engine.train_micro_batch_size_per_gpu(),
                                  engine.world_size, engine.global_rank,
                                  collate_fn=kwargs.get("collate_fn"),
                                  drop_last=bool(config.get("dataloader_drop_last", False)))
    return engine, engine.optimizer, loader, engine.lr_scheduler


class _EpochSampler(torch.utils.data.DistributedSampler):
    """A DistributedSampler whose epoch advances with each pass over the data, unless the caller
    set one since the last pass (as DeepSpeed's DeepSpeedDataLoader does with its sampler)."""

    def __init__(self, dataset, num_replicas: int, rank: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank)
        self._started = False
        self._epoch_set = False

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self._epoch_set = True

    def __iter__(self):
        if self._started and not self._epoch_set:
            self.epoch += 1
        self._started = True
        self._epoch_set = False
        return super().__iter__()


def _training_loader(dataset, batch_size: int, world_size: int, rank: int, collate_fn=None,
                     drop_last: bool = False):
    """initialize()'s loader over training_data, as DeepSpeed's: batches of the micro-batch size
    from this rank's share of the data (torch's DistributedSampler, shuffled with seed 0, its
    epoch advanced with each pass), so that under mpirun each rank reads different samples; the
    config's dataloader_drop_last drops a partial last batch."""
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size,
                                       sampler=_EpochSampler(dataset, world_size, rank),
                                       collate_fn=collate_fn, drop_last=drop_last)


def add_config_arguments(parser):
    """deepspeed.add_config_arguments: adds --deepspeed and --deepspeed_config (the config's
    path, which initialize(args=args) reads) to an argparse parser, and returns it."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (zinf.torch)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed json configuration file.")
    return parser


def init_distributed(dist_backend=None, auto_mpi_discovery=True, distributed_port=29500,
                     verbose=True, timeout=None, init_method=None, dist_init_required=None,
                     config=None, rank=-1, world_size=-1) -> None:
    """deepspeed.init_distributed's place in a ported script: takes its arguments and returns
    None, leaving torch.distributed as it is. initialize() opens zinf's own communicator
    (comm="mpi" under mpirun, MpiComm; comm="torch" under torchrun, a gloo group of its own,
    initialising torch.distributed from torchrun's environment when the script has not), whose
    rank and size are engine.global_rank and engine.world_size. So the call has nothing to set
    up.

    What a script does with torch.distributed itself (dist.barrier(), dist.all_reduce() of a
    metric, dist.get_rank()) needs torch.distributed.init_process_group() of its own (gloo, with
    the launcher's rank and size); without it those calls raise, and code guarded by
    torch.distributed.is_initialized() runs as if it were the only process. Under a launcher of
    several processes this warns, saying so (under mpirun; under torchrun initialize()
    initialises torch.distributed when the script has not). The arguments (backend, port,
    timeout, rank, world_size, ...) are DeepSpeed's and have no effect."""
    del (dist_backend, auto_mpi_discovery, distributed_port, verbose, timeout, init_method,
         dist_init_required, config, rank, world_size)
    if _choose_comm(None) != "mpi" or torch.distributed.is_initialized():
        return None
    size = (os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE")
            or os.environ.get("PMIX_SIZE") or "")
    if size.isdigit() and int(size) == 1:
        return None
    warnings.warn(
        "zinf.torch.init_distributed: torch.distributed is not initialised (zinf's engine "
        "uses its own MPI communicator: engine.global_rank and engine.world_size give this "
        "process's place); a script that calls torch.distributed itself needs "
        "torch.distributed.init_process_group() of its own", stacklevel=2)
    return None
