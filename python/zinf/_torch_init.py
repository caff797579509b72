"""zinf.torch.Init: build a model without holding it whole in host memory (DeepSpeed's
deepspeed.zero.Init, for zinf's engine).

Inside `with zinf.torch.Init(config=config):`, every nn.Module constructor that ends (the
outermost __init__ of each module object) hands its own parameters over: their values, as
initialised by the constructor, are appended as fp32 to a staging file, and each parameter's
.data becomes an empty placeholder. So at most one module's parameters are whole in memory at a
time. zinf.torch.initialize() then registers each staged parameter with an engine initializer
(ParameterSpec::initializer) that reads only the elements of this rank's partition from the
staging file during finalize(), straight into the engine's fp32 master (on the device, in host
memory or on NVMe), and closes the file.

The staging file lives in the config's offload_param (else offload_optimizer) nvme_path, or in
the system's temporary directory, and is unlinked as soon as it is created: it takes the model's
fp32 size on that disk until initialize() is done with it, and never outlives the process.

Initialisation that runs after a module's constructor (transformers' post_init, a custom
init_weights) sees the placeholders; do it inside GatheredParameters(params, modifier_rank=0),
which reads the staged values and writes changes back to the staging file. With several ranks
and torch.distributed initialised, the block's end broadcasts rank modifier_rank's values and
every rank stages them (broadcast_staged), as DeepSpeed broadcasts at the end of the block;
without torch.distributed, initialize() writes them over every rank's.
"""
from __future__ import annotations

import enum
import hashlib
import itertools
import os
import tempfile

import torch
from torch import nn

_counter = itertools.count()


class _StagingFile:
    """An unlinked file of fp32 values, appended to by Init and read by the initializers."""

    def __init__(self, directory: str):
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"zinf-init-{os.getpid()}-{next(_counter)}.f32")
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.unlink(path)
        self.size = 0
        self.users = 0  # staged parameters not yet registered with an engine

    def append(self, tensor: torch.Tensor) -> tuple[int, int]:
        """Appends the values as fp32; returns (their offset, their hash)."""
        values = tensor.detach().to(device="cpu", dtype=torch.float32).contiguous()
        offset = self.size
        self.write(offset, values)
        self.size += values.numel() * 4
        return offset, _values_hash(values)

    def write(self, offset: int, values: torch.Tensor):
        view = memoryview(values.numpy()).cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], offset + done)

    def read_into(self, offset: int, out) -> None:
        view = memoryview(out).cast("B")
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:
                raise OSError(f"zinf.torch.Init: staging file {self.path}: short read at byte "
                              f"{offset + done}")
            done += got

    def release_one(self):
        self.users -= 1
        if self.users == 0 and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _values_hash(values: torch.Tensor) -> int:
    """A 64-bit hash of fp32 values (never 0, which means "none" to the engine)."""
    digest = hashlib.blake2b(memoryview(values.numpy()).cast("B"), digest_size=8).digest()
    return int.from_bytes(digest, "little") | 1


class Staged:
    """Where a parameter built under Init keeps its values until an engine takes them."""

    __slots__ = ("file", "offset", "shape", "dtype", "values_hash", "modifier_rank", "what",
                 "stale_read")

    def __init__(self, file: _StagingFile, offset: int, shape, dtype, values_hash: int,
                 what: str = "a parameter"):
        self.file = file
        # How messages name it (its module's class and attribute: the model's qualified names
        # are known only at initialize()).
        self.what = what
        # A GatheredParameters block on this rank read it after another rank's block changed it
        # (warned once).
        self.stale_read = False
        self.offset = offset
        self.shape = tuple(shape)
        self.dtype = dtype
        # Of the values staged: the engine compares it across ranks at finalize
        # (ParameterSpec::initializer_values_hash).
        self.values_hash = values_hash
        # The modifier_rank of the last GatheredParameters block that changed it and could not
        # broadcast its values (torch.distributed not initialised; None: no such block, or a
        # later block broadcast them): initialize() writes that rank's values over every rank's.
        self.modifier_rank = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def initializer(self, first: int, out) -> None:
        """ParameterSpec::initializer: elements [first, first + len(out)) into out."""
        self.file.read_into(self.offset + first * 4, out)

    def load(self) -> torch.Tensor:
        """The whole parameter, fp32 (GatheredParameters before initialize())."""
        out = torch.empty(self.shape, dtype=torch.float32)
        self.file.read_into(self.offset, out.numpy())
        return out

    def store(self, values: torch.Tensor):
        values = values.detach().to(torch.float32).contiguous()
        self.file.write(self.offset, values)
        self.values_hash = _values_hash(values)

    def done(self):
        self.file.release_one()


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's deepspeed.runtime.zero.partition_parameters.ZeroParamStatus, which a ZeRO-3
    parameter's ds_status gives. zinf's gathers complete before the module runs, so a parameter
    is never INFLIGHT."""

    AVAILABLE = 1  # the full values are in .data
    NOT_AVAILABLE = 2  # .data is an empty placeholder
    INFLIGHT = 3


_param_ids = itertools.count()


class ZeroParameter(nn.Parameter):
    """The class of a ZeRO-3 parameter: one built under Init (until initialize() gives it to an
    engine below stage 3) or registered with a stage-3 engine. It carries DeepSpeed's attributes
    that scripts read: ds_id (a unique int), ds_shape (the full shape, a torch.Size), ds_numel,
    and ds_status, computed on each read from what .data holds (AVAILABLE while the full values
    are there: inside GatheredParameters or the module's forward and backward; NOT_AVAILABLE
    while it is the empty placeholder). DeepSpeed's ds_tensor (the rank's partition) is not
    given: the engine holds the partition, as fp32 master on its tier. Pickling (torch.save of
    the parameter) leaves out zinf's links to its engine and staging, and a deep copy is a
    plain nn.Parameter."""

    @property
    def ds_status(self) -> ZeroParamStatus:
        shape = self.__dict__.get("ds_shape")
        if shape is None:
            raise AttributeError("ds_status")  # a copy made by torch, not one of zinf's
        return (ZeroParamStatus.AVAILABLE if self.shape == shape
                else ZeroParamStatus.NOT_AVAILABLE)

    def __getstate__(self):
        # What nn.Parameter's own pickling saves besides the data: the user's attributes only.
        return {key: value for key, value in self.__dict__.items()
                if not key.startswith(("_zinf_", "ds_"))}

    def __deepcopy__(self, memo):
        if id(self) not in memo:
            memo[id(self)] = nn.Parameter(self.data.clone(memory_format=torch.preserve_format),
                                          self.requires_grad)
        return memo[id(self)]


def make_zero3(param: nn.Parameter, shape) -> None:
    """Makes `param` a ZeroParameter of full shape `shape` (its ds_id kept if it has one)."""
    if type(param) is nn.Parameter:
        param.__class__ = ZeroParameter
    elif not isinstance(param, ZeroParameter):
        return  # a parameter subclass of another library's: left as it is
    if "ds_id" not in param.__dict__:
        param.ds_id = next(_param_ids)
    param.ds_shape = torch.Size(shape)
    param.ds_numel = param.ds_shape.numel()


def unmake_zero3(param: nn.Parameter) -> None:
    """Makes a ZeroParameter a plain nn.Parameter again (an engine below stage 3 took it)."""
    if type(param) is ZeroParameter:
        param.__class__ = nn.Parameter
        for key in ("ds_id", "ds_shape", "ds_numel"):
            param.__dict__.pop(key, None)


def _module_subclasses():
    seen, stack = set(), [nn.Module]
    while stack:
        cls = stack.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.add(sub)
                stack.append(sub)
    return seen


class Init:
    """deepspeed.zero.Init for zinf: modules constructed inside the block hand their parameters
    over as their constructors end, so the model is never whole in host memory.

        with zinf.torch.Init(config=config):
            model = MyModel()
        engine, _, _, _ = zinf.torch.initialize(model=model, config=config)

    The arguments are DeepSpeed's, in its order (deepspeed/runtime/zero/partition_parameters.py,
    Init.__init__), so a positional call means what it means there; staging_dir, zinf's own, is
    keyword-only. config_dict_or_path (or config, DeepSpeed's deprecated name, which wins where
    both are given, as in DeepSpeed): the run's config, a dict or a JSON file's path, used for
    where to stage (the nvme_path of offload_param, else of offload_optimizer); staging_dir
    overrides it. enabled=False makes the block do nothing. module (converting a model built
    beforehand) is refused; DeepSpeed's other arguments (data_parallel_group,
    mem_efficient_linear, remote_device, pin_memory, dtype, mpu, the ZeRO++ and sequence
    parallel groups, param_swapper) are accepted and ignored, as is tensor_overrides, which is
    zinf's own (DeepSpeed's Init has no such argument) and unused.

    Blocks nest as DeepSpeed's do (Hugging Face's from_pretrained opens its own inside a
    script's): the outermost enabled block wraps the constructors and owns the staging file, and
    an inner one joins it, so a module built inside both is staged once, into the outer block's
    file. An inner block's config and staging_dir are not used (DeepSpeed's inner blocks, too,
    run with the outermost one's settings); an inner block with enabled=False changes nothing.
    staged_bytes counts the bytes staged while the block was open, nested blocks' included."""

    # The outermost enabled block while one is open, and every enabled block open (outermost
    # first; an inner one joins the outermost).
    _active: "Init | None" = None
    _open: "list[Init]" = []

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True,
                 remote_device=None, pin_memory=False, config_dict_or_path=None, config=None,
                 enabled: bool = True, dtype=None, mpu=None, zero_param_parallel_group=None,
                 zero_quantized_weights=False, zero_quantized_nontrainable_weights=False,
                 sequence_data_parallel_group=None, param_swapper=None, tensor_overrides=None,
                 *, staging_dir: str | None = None, **_deepspeed_args):
        if module is not None:
            raise NotImplementedError("Init(module=...): converting a model built beforehand is "
                                      "not supported; build it inside the block")
        self.enabled = enabled
        config = config if config is not None else config_dict_or_path
        if isinstance(config, (str, os.PathLike)):
            from .torch import _load_config_text
            with open(config) as f:
                config = _load_config_text(f.read(), os.fspath(config))
        self.staging_dir = staging_dir or _staging_dir_of(config or {})
        self._file: _StagingFile | None = None
        self._patched: dict[type, object] = {}
        self._saved_init_subclass = None
        self.staged_bytes = 0

    # ---- the block ------------------------------------------------------------------------------

    def __enter__(self):
        if not self.enabled:
            return self
        if Init._active is not None:
            Init._open.append(self)
            return self  # joins the outermost block, which stages for both
        # Registered only once its staging file is open: a block whose __enter__ raised gets no
        # __exit__, and must not leave later blocks joining it.
        self._file = _StagingFile(self.staging_dir)
        Init._open.append(self)
        Init._active = self
        for cls in _module_subclasses():
            self._wrap(cls)
        init = self
        saved = nn.Module.__dict__.get("__init_subclass__")
        self._saved_init_subclass = saved

        @classmethod
        def init_subclass(cls, **kwargs):
            if saved is not None:
                saved.__get__(None, cls)(**kwargs)
            init._wrap(cls)

        nn.Module.__init_subclass__ = init_subclass
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        # Blocks close innermost first; the outermost's exit restores the constructors.
        if Init._open and Init._open[-1] is self:
            Init._open.pop()
        else:
            Init._open.remove(self)
        if Init._active is not self or self in Init._open:
            return False
        for cls, original in self._patched.items():
            cls.__init__ = original
        self._patched.clear()
        if self._saved_init_subclass is None:
            del nn.Module.__init_subclass__
        else:
            nn.Module.__init_subclass__ = self._saved_init_subclass
        Init._active = None
        if self._file is not None and self._file.users == 0:
            os.close(self._file.fd)
            self._file.fd = -1
        return False

    def _wrap(self, cls):
        original = cls.__dict__.get("__init__")
        if original is None or cls in self._patched:
            return
        init = self

        def __init__(module, *args, **kwargs):
            depth = module.__dict__.get("_zinf_init_depth", 0)
            object.__setattr__(module, "_zinf_init_depth", depth + 1)
            try:
                original(module, *args, **kwargs)
            finally:
                object.__setattr__(module, "_zinf_init_depth", depth)
            if depth == 0:
                del module.__dict__["_zinf_init_depth"]
                init._stage(module)

        __init__.__wrapped__ = original
        self._patched[cls] = original
        cls.__init__ = __init__

    def _stage(self, module: nn.Module):
        for key, param in module._parameters.items():
            if param is None or hasattr(param, "_zinf_staged"):
                continue
            offset, values_hash = self._file.append(param)
            self._file.users += 1
            param._zinf_staged = Staged(self._file, offset, param.shape, param.dtype,
                                        values_hash, f"{type(module).__name__}.{key}")
            for block in dict.fromkeys(Init._open):
                block.staged_bytes += param.numel() * 4
            param.data = torch.empty(0, dtype=param.dtype)
            make_zero3(param, param._zinf_staged.shape)


def nvme_paths(config) -> list[str]:
    """The nvme_paths of the config's offload_param and offload_optimizer sections (in that
    order) whose device is "nvme". It runs before the engine validates the config, so it skips
    any part that does not have the type the config's schema gives it: the engine's validation
    then reports that key by name."""
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    if not isinstance(zero, dict):
        return []
    paths = []
    for key in ("offload_param", "offload_optimizer"):
        section = zero.get(key)
        if not isinstance(section, dict) or section.get("device") != "nvme":
            continue
        path = section.get("nvme_path")
        if isinstance(path, str) and path:
            paths.append(path)
    return paths


def _staging_dir_of(config) -> str:
    paths = nvme_paths(config)
    return paths[0] if paths else tempfile.gettempdir()


def staged(param) -> Staged | None:
    """The staging of a parameter built under Init and not yet taken by an engine."""
    return getattr(param, "_zinf_staged", None)


def launch_rank() -> int | None:
    """This process's rank as its launcher set it (torchrun's RANK, mpirun's or srun's), before
    an engine exists; None when no launcher says."""
    for variable in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        value = os.environ.get(variable)
        if value is not None and value.isdigit():
            return int(value)
    return None


# The gloo group broadcast_group() made beside a default group of another backend, and that
# default group (a new default group gets a new one).
_gloo_group: tuple[object, object] | None = None


def broadcast_group():
    """The torch.distributed group over which a GatheredParameters(modifier_rank=r) block
    broadcasts the staged values of its parameters at its end, or None when torch.distributed is
    not initialised or has one rank (the block then leaves rank r's values to initialize()). The
    default group when its backend takes CPU tensors (gloo: deepspeed.init_distributed(),
    Accelerate on the CPU); otherwise a gloo group of the same ranks, made once (a collective
    call: every rank enters the block)."""
    global _gloo_group
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    world = dist.group.WORLD
    if "gloo" in str(dist.get_backend()):
        return world
    if _gloo_group is None or _gloo_group[0] is not world:
        _gloo_group = (world, dist.new_group(backend="gloo"))
    return _gloo_group[1]


def broadcast_staged(loaded: "list[tuple[nn.Parameter, Staged]]", root: int, group,
                     failed: bool = False) -> None:
    """The end of a GatheredParameters(modifier_rank=root) block before initialize(), with
    several ranks: rank root's values of the block's staged parameters (each holding its full
    values in .data) are broadcast over `group` and staged on every rank, as DeepSpeed's block
    broadcasts them at its end, so that every rank reads rank root's values from then on and
    finalize() compares the ranks' values again. The parameters are put in ds_id order (the same
    on every rank, whatever order the block was given them in; those of another library's
    parameter class, which have none, first, in the block's order) and flattened into one buffer per
    dtype, one broadcast each; each parameter's values move into the buffer and its .data
    becomes the empty placeholder, so the rank holds about the block's gathered size, not
    twice it. Every rank must call it with the same parameters (every rank entered the block),
    `failed` saying whether the block raised on this rank.

    Before any values move, rank root checks every parameter's shape and broadcasts the outcome,
    so that every rank ends the same way and none is left waiting in a broadcast: when a
    parameter's .data no longer has its full shape on rank root, every rank raises the same
    ValueError naming it and both shapes, and nothing is staged; when the block raised on rank
    root (failed), nothing is broadcast and every rank keeps its staged values, as one rank
    keeps them when its block raises. A block that raised on another rank only still takes
    rank root's values."""
    dist = torch.distributed
    rank = dist.get_rank()
    unique = {id(param): (param, stage) for param, stage in loaded}
    ordered = sorted(unique.values(), key=lambda item: getattr(item[0], "ds_id", -1))
    # Rank root's outcome in one broadcast: whether the block raised there, and the position in
    # `ordered` of the first parameter left with another shape there (-1: none) and that
    # shape's length; only then its shape follows, and every rank words the same error from it.
    header = torch.tensor([0, -1, 0], dtype=torch.int64)
    if rank == root:
        if failed:
            header[0] = 1
        else:
            for index, (param, stage) in enumerate(ordered):
                if tuple(param.data.shape) != stage.shape:
                    header[1:] = torch.tensor([index, param.data.dim()])
                    break
    dist.broadcast(header, src=root, group=group)
    raised_on_root, bad, dims = header.tolist()
    if raised_on_root:
        return
    if bad >= 0:
        shape = torch.tensor(ordered[bad][0].data.shape if rank == root else [0] * dims,
                             dtype=torch.int64)
        if dims > 0:
            dist.broadcast(shape, src=root, group=group)
        stage = ordered[bad][1]
        raise ValueError(f"GatheredParameters(modifier_rank={root}): {stage.what} has shape "
                         f"{tuple(shape.tolist())} at the end of the block on rank {root}, not "
                         f"its shape {stage.shape}; change its values, not its shape")
    by_dtype: dict[torch.dtype, list[tuple[nn.Parameter, Staged]]] = {}
    for param, stage in ordered:
        by_dtype.setdefault(stage.dtype, []).append((param, stage))
    for dtype, members in by_dtype.items():
        flat = torch.empty(sum(stage.numel for _, stage in members), dtype=dtype)
        offset = 0
        for param, stage in members:
            if rank == root:
                flat[offset:offset + stage.numel].view(stage.shape).copy_(param.data)
            param.data = torch.empty(0, dtype=stage.dtype)
            offset += stage.numel
        # As bytes: a copy, whatever dtypes the group's backend reduces.
        dist.broadcast(flat.view(torch.uint8), src=root, group=group)
        offset = 0
        for _, stage in members:
            stage.store(flat[offset:offset + stage.numel].view(stage.shape))
            stage.modifier_rank = None
            stage.stale_read = False
            offset += stage.numel
        del flat
