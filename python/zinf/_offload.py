"""Saved activations through the engine's activation store (docs/ACTIVATIONS.md, docs/PYTHON.md).

    with zinf.torch.offload_saved_tensors(engine):   # every tensor autograd saves goes to the
        loss = engine(batch)                         # store (host arena, NVMe beyond it) and
    engine.backward(loss)                            # comes back when backward needs it

(A model outside zinf.torch, using only a bare zinf._zinf.Engine's store, runs loss.backward().)

    h = zinf.torch.checkpoint(block, h, engine=engine)   # torch.utils.checkpoint.checkpoint
                                                          # whose saved inputs go to the store

How it works:
- A pack hook (torch.autograd.graph.saved_tensors_hooks) copies the tensor's bytes into the store
  under a key and returns a small handle in its place; the unpack hook allocates a tensor of the
  same shape, strides and dtype and loads the bytes back into it. The values are the same bits, so
  gradients are bit-equal to a run without offload.
- Keys are "saved_tensor.<bytes>.<n>": n is the lowest index free among the tensors of that size
  held now. A forward pass therefore saves the same keys in the same order every step, which the
  store needs: it records the first forward's order to read ahead in reverse, and it keeps one
  NVMe extent per key. A handle whose graph is dropped without a backward frees its key (and the
  stored bytes) when it is collected.
- The store copies asynchronously: the bytes at the tensor must stay unchanged until the store's
  next call returns, so the last saved tensor is held until then.
- checkpoint() is torch.utils.checkpoint.checkpoint with use_reentrant=False run inside such a
  context: torch saves the function's inputs with save_for_backward (its _NoopSaveInputs), which
  the outer hooks see, while the tensors saved inside the function go to torch's own recompute
  hooks (inner hooks win). So the inputs live in the store and everything else is recomputed.
- Tensors on the engine's HostDevice are CPU tensors; other devices' tensors, sparse tensors,
  empty ones and those below min_bytes are left to autograd as they are. offload_saved_tensors
  leaves parameters (and views of them) alone: they stay in memory anyway.
- A stage-3 zinf.torch engine's forward installs its own hooks (they save views of gathered
  parameters as references to re-gather); those are inner to the caller's, so they pass every
  other tensor on to the innermost offload_saved_tensors context entered (active_offload()).
"""
from __future__ import annotations

import heapq
import weakref

import torch
from torch import nn

from . import _zinf

_stores: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# The offload_saved_tensors contexts entered, innermost last: a stage-3 zinf.torch engine's own
# saved-tensor hooks (inner to the caller's) hand the tensors that are not parameter views to the
# innermost one.
_active: list = []


def active_offload() -> "offload_saved_tensors | None":
    return _active[-1] if _active else None


def _core_of(engine) -> "_zinf.Engine":
    core = getattr(engine, "_core", engine)
    if not isinstance(core, _zinf.Engine):
        raise TypeError(f"engine: expected a zinf.torch engine or a zinf._zinf.Engine, got "
                        f"{type(engine).__name__}")
    return core


def store_for(engine) -> "_ActivationStore":
    """The key allocator of `engine`'s activation store (one per engine, shared by every context
    over it, so that keys never collide)."""
    core = _core_of(engine)
    store = _stores.get(core)
    if store is None:
        store = _ActivationStore(core)
        _stores[core] = store
    return store


def _dense_order(tensor: torch.Tensor):
    """The permutation that makes `tensor` contiguous when its elements fill their memory span
    exactly (contiguous, transposed, permuted), else None."""
    order = sorted(range(tensor.dim()), key=lambda d: (-tensor.stride(d), -tensor.size(d)))
    expected = 1
    for d in reversed(order):
        if tensor.size(d) != 1 and tensor.stride(d) != expected:
            return None
        expected *= tensor.size(d)
    return order


def _flat_bytes(tensor: torch.Tensor, order) -> torch.Tensor:
    """A 1-D uint8 view over the bytes of the contiguous tensor tensor.permute(order)."""
    return tensor.permute(order).reshape(-1).view(torch.uint8)


class _SavedActivation:
    """What autograd keeps in place of an offloaded tensor: its key and how to rebuild it."""

    __slots__ = ("store", "key", "index", "nbytes", "size", "stride", "order", "dtype", "tensor",
                 "__weakref__")

    def __init__(self, store, key, index, nbytes, size, stride, order, dtype):
        self.store, self.key, self.index, self.nbytes = store, key, index, nbytes
        self.size, self.stride, self.order, self.dtype = size, stride, order, dtype
        self.tensor = None  # once loaded (a second unpack, retain_graph, returns it)

    def unpack(self) -> torch.Tensor:
        if self.tensor is None:
            self.tensor = self.store.load(self)
        return self.tensor

    def __del__(self):
        # A graph freed without its backward: the checkpoint would stay in the store, and its key
        # could not be saved again.
        if self.tensor is None and self.store is not None:
            try:
                self.store.discard(self)
            except Exception:  # noqa: BLE001 - at interpreter exit or after the engine closed
                pass


class _ActivationStore:
    """Keys, the last saved tensor (held while the store copies it) and save/load of one engine."""

    def __init__(self, core: "_zinf.Engine"):
        self._core = core
        self._free: dict[int, list[int]] = {}  # bytes -> free indices (a heap)
        self._count: dict[int, int] = {}  # bytes -> indices handed out so far
        self._pending = None  # the last tensor saved: its bytes are being copied

    def _take_key(self, nbytes: int):
        free = self._free.setdefault(nbytes, [])
        if free:
            index = heapq.heappop(free)
        else:
            index = self._count.get(nbytes, 0)
            self._count[nbytes] = index + 1
        return index, f"saved_tensor.{nbytes}.{index}"

    def _give_key(self, nbytes: int, index: int):
        heapq.heappush(self._free[nbytes], index)

    def save(self, tensor: torch.Tensor) -> _SavedActivation:
        order = _dense_order(tensor)
        source = tensor
        if order is None:
            source = tensor.contiguous()
            order = list(range(tensor.dim()))
        flat = _flat_bytes(source.detach(), order)
        nbytes = flat.numel()
        index, key = self._take_key(nbytes)
        try:
            self._core.save_activation(key, flat)
        except BaseException:
            self._give_key(nbytes, index)
            raise
        self._pending = flat
        return _SavedActivation(self, key, index, nbytes, tuple(source.size()),
                                tuple(source.stride()), order, tensor.dtype)

    def load(self, saved: _SavedActivation) -> torch.Tensor:
        out = torch.empty_strided(saved.size, saved.stride, dtype=saved.dtype)
        try:
            self._core.load_activation(saved.key, _flat_bytes(out, saved.order))
        except _zinf.Error as error:  # an I/O error, a checksum mismatch, a closed engine
            raise _zinf.Error(f"zinf: saved tensor '{saved.key}' ({saved.dtype}, "
                              f"{list(saved.size)}) could not be loaded for the backward pass: "
                              f"{error}") from error
        self._pending = None
        self._give_key(saved.nbytes, saved.index)
        return out

    def discard(self, saved: _SavedActivation):
        scratch = torch.empty(saved.nbytes, dtype=torch.uint8)
        self._core.load_activation(saved.key, scratch)
        self._pending = None
        self._give_key(saved.nbytes, saved.index)
        saved.store = None


def _is_parameter(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


class offload_saved_tensors(torch.autograd.graph.saved_tensors_hooks):
    """A context in which every tensor autograd saves for the backward pass goes to `engine`'s
    activation store (the config's activation_checkpointing section: cpu_checkpointing, and
    zinf.activation_host_bytes / activation_nvme_path for the host arena and NVMe beyond it) and
    is loaded back when the backward pass needs it. No recomputation: gradients are the same bits
    as without it. Tensors smaller than `min_bytes`, parameters (and views of them) and tensors
    that are not strided CPU tensors stay where they are. `engine` is a zinf.torch engine or a
    zinf._zinf.Engine."""

    def __init__(self, engine, min_bytes: int = 0, include_parameters: bool = False):
        self.store = store_for(engine)
        self.min_bytes = int(min_bytes)
        self.include_parameters = include_parameters
        super().__init__(self._pack, _unpack)

    def __enter__(self):
        super().__enter__()
        _active.append(self)
        return self

    def __exit__(self, *exc):
        _active.remove(self)
        return super().__exit__(*exc)

    def _pack(self, tensor: torch.Tensor):
        if (tensor.layout != torch.strided or tensor.device.type != "cpu" or tensor.numel() == 0
                or tensor.numel() * tensor.element_size() < self.min_bytes
                or (not self.include_parameters and _is_parameter(tensor))):
            return tensor
        return self.store.save(tensor)


def _unpack(saved):
    return saved.unpack() if isinstance(saved, _SavedActivation) else saved


def checkpoint(function, *args, engine=None, **kwargs):
    """torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs) whose
    saved inputs (each tensor argument) are stored in `engine`'s activation store, offloaded as
    its config says, instead of being held by autograd; the function's own activations are
    recomputed in the backward pass. `engine` defaults to the one zinf.torch engine open.
    preserve_rng_state, context_fn and determinism_check are torch's."""
    if engine is None:
        from .torch import _open_engines  # the one engine of the usual program

        engines = list(_open_engines)
        if len(engines) != 1:
            raise ValueError(f"zinf.torch.checkpoint: pass engine=; {len(engines)} zinf engines "
                             "are open")
        engine = engines[0]
    if kwargs.pop("use_reentrant", False):
        raise ValueError("zinf.torch.checkpoint: use_reentrant=True is not supported (its saved "
                         "inputs bypass saved-tensor hooks)")
    with offload_saved_tensors(engine, include_parameters=True):
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)
