"""zinf.torch.GatheredParameters (deepspeed.zero.GatheredParameters for zinf): full parameters
inside a `with` block, for reading or, with modifier_rank, changing them."""
from __future__ import annotations

import hashlib
import warnings
from typing import TYPE_CHECKING

import torch
from torch import nn

from . import _torch_init, _zinf

if TYPE_CHECKING:
    from .torch import ZinfEngine


def engine_of(param) -> "ZinfEngine | None":
    """The live engine that trains `param`, or None."""
    ref = getattr(param, "_zinf_engine", None)
    return ref() if ref is not None else None


class GatheredParameters:
    """deepspeed.zero.GatheredParameters: inside the `with` block the given parameters hold
    their full values, for reading (exporting weights) or, with modifier_rank set, for changing
    them (a custom initialisation, loading weights):

        with zinf.torch.GatheredParameters(model.lm_head.parameters()):
            weights = model.lm_head.weight.detach().clone()
        with zinf.torch.GatheredParameters(model.lm_head.weight, modifier_rank=0):
            torch.nn.init.zeros_(model.lm_head.weight)

    - Parameters trained by a zinf engine: at stage 3 their engine modules are gathered for the
      block (at stages 1 and 2 they always are), and a parameter whose module the block gathered
      holds a copy of the gathered values for the block (host memory: the gathered size again,
      until the block ends): the engine reuses its gathered memory after the release, and a
      tensor taken in the block (`p.data.cpu()`) keeps its values. With modifier_rank=r, each
      parameter changed in the block, however (in place, through .data, or its .data
      replaced), is written at its end
      into the engine's fp32 master from rank r's values (Engine::write_parameters, which then
      republishes the parameters); the optimizer moments stay. A change is found by comparing
      the block's copy with the gathered values it was made from (ops on .data do not move the
      version counter), or, for a parameter whose module was gathered already, a digest of the
      values with one taken on entry (the digest itself copies nothing). With several ranks
      rank r finds its changes so and broadcasts which parameters it changed, and every rank
      writes those, in the engine's parameter order (the ranks may list them in any order);
      the others keep their fp32 masters to the bit (a block that changes nothing writes
      nothing). The values written are converted to fp32 one parameter at a time as the write
      reaches them. Use it between steps: after a backward
      whose step has not run it raises zinf.Error naming the parameter, before anything is
      gathered. Every rank must enter the block (the write is collective); the block's writes
      are one write of the changed parameters' groups, however many parameters it changed,
      and at stages 1 and 2 only the block's own parameters are pointed back at the engine's
      device copy: the engine never moves that copy, and a parameter outside the block whose
      .data the script re-pointed keeps the script's tensor until the next step() or
      load_checkpoint(), which put every view back.
      Every rank takes part in the block's end even when the block raised on it, so that no
      rank is left waiting: when it raised on rank r nothing is written (as with one rank);
      when it raised on another rank only, rank r's changes are written on every rank, and
      then the exception propagates there. At stages 1 and 2 the block's parameters are on
      the engine's copy afterwards whether or not it raised; at stage 3 a module the block
      gathered is released as after any block, its parameters empty placeholders again, not
      the tensors the block pointed their .data at.
    - Parameters built under zinf.torch.Init and not yet given to initialize(): their staged
      values are read into them for the block and, with modifier_rank set, written back to the
      staging file, so initialize() takes them. With several ranks and torch.distributed
      initialised (deepspeed.init_distributed(), the Trainer), the block's end broadcasts rank
      modifier_rank's values and every rank stages them, as DeepSpeed's block does, so every
      rank reads them from then on (_torch_init.broadcast_staged; every rank must enter the
      block, as the broadcast is collective). Rank modifier_rank first checks the shapes and
      every rank learns the outcome before any values move: a parameter left with another
      shape there makes every rank raise the same ValueError naming it and both shapes, and a
      block that raised there broadcasts nothing (every rank keeps its staged values); one that
      raised on another rank only still takes rank modifier_rank's values. Without
      torch.distributed,
      initialize() writes rank modifier_rank's values over every rank's (Engine::write_parameters,
      one write for all of them, which costs the named parameters' groups, in runs of
      neighbouring groups, not the whole partition), and until then another rank reads its own
      (a RuntimeWarning says so: _warn_stale_read).
    Other parameters are left as they are. Changes made without modifier_rank are not kept
    (at stage 3 they are lost at release; at stages 1 and 2 the next step overwrites them)."""

    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled: bool = True):
        listed = [params] if params is None or isinstance(params, torch.Tensor) else list(params)
        # None stands for a parameter a module lacks (a Linear's bias=False): DeepSpeed's block
        # leaves it out (its block over None alone does nothing).
        self._params = [param for param in listed if param is not None]
        self._modifier_rank = modifier_rank
        self._enabled = enabled
        self._held: list[tuple["ZinfEngine", str]] = []
        self._loaded: list[tuple[nn.Parameter, _torch_init.Staged]] = []
        # Engine parameters and how they looked on entry: the data pointer, and on the rank whose
        # changes count (the only one, or the modifier rank) what the values are compared with at
        # the end: the engine's view the block's copy was made from, or a digest of the values.
        self._watched: list[tuple["ZinfEngine", nn.Parameter, int,
                                  torch.Tensor | bytes | None]] = []
        # Stage 3, modules this block gathered: each parameter and the engine's view, which the
        # parameter gives way to a copy of for the block.
        self._copied: list[tuple[nn.Parameter, torch.Tensor]] = []
        # Parameters built under Init, with modifier_rank and several ranks: the torch.distributed
        # group that broadcasts their values at the block's end (None: initialize() writes them).
        self._group = None

    def __enter__(self):
        if not self._enabled:
            return self
        if self._modifier_rank is not None:
            _refuse_write_before_step(self._params)
            if any(_torch_init.staged(param) is not None for param in self._params):
                self._group = _torch_init.broadcast_group()
                world_size = torch.distributed.get_world_size() if self._group else 1
                if self._group is not None and not 0 <= self._modifier_rank < world_size:
                    raise ValueError(f"GatheredParameters(modifier_rank={self._modifier_rank}): "
                                     f"torch.distributed has ranks 0 to {world_size - 1}")
            for param in self._params:
                engine = engine_of(param)
                if (engine is not None and engine.world_size > 1
                        and not 0 <= self._modifier_rank < engine.world_size):
                    raise ValueError(f"GatheredParameters(modifier_rank={self._modifier_rank}): "
                                     f"the engine has ranks 0 to {engine.world_size - 1}")
        gathered_here: set[tuple[int, str]] = set()  # (engine, module) gathered by the block
        copied: set[int] = set()
        for param in _in_engine_order(self._params):
            stage = _torch_init.staged(param)
            if stage is not None:
                _warn_stale_read(stage, self._modifier_rank)
                param.data = stage.load().to(stage.dtype)
                self._loaded.append((param, stage))
                continue
            engine = engine_of(param)
            if engine is None:
                continue
            if engine.stage == 3:
                owner = engine._owner[id(param)]
                if engine._gather_count[owner] == 0:
                    gathered_here.add((id(engine), owner))
                engine._acquire(owner)
                self._held.append((engine, owner))
                if (id(engine), owner) in gathered_here and id(param) not in copied:
                    copied.add(id(param))
                    # The block's own copy: the engine's gathered memory is reused once the
                    # module is released, and a tensor taken in the block (DeepSpeed-Chat keeps
                    # `p.data.cpu()`, the same tensor on a CPU engine) must keep its values.
                    view = param.data
                    param.data = view.clone()
                    self._copied.append((param, view))
            if self._modifier_rank is not None:
                # On the rank whose changes count (the only one, or the modifier rank), what the
                # end compares the values with: the view the block's copy was made from (the
                # block changes the copy only), else a digest.
                entry = None
                if engine.world_size == 1 or engine.global_rank == self._modifier_rank:
                    entry = (self._copied[-1][1] if self._copied and self._copied[-1][0] is param
                             else _digest(param))
                self._watched.append((engine, param, param.data_ptr(), entry))
        # Marks the block's engine parameters as being modified until the end: with several
        # ranks, torch's load_state_dict() of them is let through only then (the end writes the
        # loaded values into the masters; outside a block the engine refuses the load).
        for engine, param, _, _ in self._watched:
            engine._modifying[id(param)] = engine._modifying.get(id(param), 0) + 1
        return self

    def __exit__(self, *exc):
        # The parameters changed on the rank whose changes count (the only one, or the modifier
        # rank; none when the block raised there): those whose values differ from the engine's
        # view the block's copy was made from, or whose digest differs from the one taken on
        # entry, or whose .data was replaced (the write points it back at the engine's memory).
        # Each keeps the tensor that holds its values, in its own dtype: the write converts them
        # to fp32 one parameter at a time, as it reaches them. Copied (in their dtype) where they
        # are the engine's memory, which the release below gives back or the write republishes
        # (the block's own copy, or a tensor of the script's, is kept as it is).
        changed: dict = {}  # engine -> {id(param): (param, values)}, engines in block order
        block: dict = {}  # engine -> the block's parameters it trains
        for engine, param, _, _ in self._watched:
            count = engine._modifying.pop(id(param)) - 1
            if count > 0:
                engine._modifying[id(param)] = count
        for engine, param, ptr, entry in self._watched:
            writes = changed.setdefault(engine, {})
            block.setdefault(engine, []).append(param)
            if exc[0] is not None or entry is None or id(param) in writes:
                continue
            if (param.data_ptr() != ptr
                    or (not _same_bits(param.data, entry) if isinstance(entry, torch.Tensor)
                        else _digest(param) != entry)):
                values = param.detach()
                if (engine.stage < 3
                        or values.untyped_storage().data_ptr() in engine._gathered_ptrs):
                    values = values.clone()
                writes[id(param)] = (param, values)
        self._watched.clear()
        # The engine's views back before the release, which drops them.
        while self._copied:
            param, view = self._copied.pop()
            param.data = view
        while self._held:
            engine, owner = self._held.pop()
            engine._release(owner)
        # With several ranks every rank takes part, whether the block raised on it or not (the
        # modifier rank says which parameters it changed, and every rank writes those), so that
        # no rank is left waiting; with one, an engine with nothing changed is not called.
        for engine, writes in changed.items():
            if writes or engine.world_size > 1:
                engine._write_parameters(list(writes.values()), self._modifier_rank,
                                         block[engine])
            elif exc[0] is not None:
                # One rank and the block raised: nothing is written, but a parameter whose .data
                # the block replaced goes back on the engine's copy (stages 1 and 2), as the
                # write would have put it.
                engine._refresh_views(block[engine])
        if self._group is not None:
            # Rank modifier_rank's values to every rank's staging, as DeepSpeed broadcasts them;
            # every rank takes part even when the block raised on it (when it raised on the
            # modifier rank, nothing is broadcast and every rank keeps its staged values).
            loaded, self._loaded = self._loaded, []
            try:
                _torch_init.broadcast_staged(loaded, self._modifier_rank, self._group,
                                             exc[0] is not None)
            finally:
                for param, stage in loaded:
                    param.data = torch.empty(0, dtype=stage.dtype)
        while self._loaded:
            param, stage = self._loaded.pop()
            if self._modifier_rank is not None and exc[0] is None:
                stage.store(param.data)
                stage.modifier_rank = self._modifier_rank
            param.data = torch.empty(0, dtype=stage.dtype)
        return False


def _warn_stale_read(stage: _torch_init.Staged, modifier_rank) -> None:
    """Warns (once per parameter) when this rank reads, before initialize(), a parameter that
    another rank changed inside GatheredParameters(modifier_rank=r) while torch.distributed was
    not initialised: the block's end could not broadcast it, so the change reaches the other
    ranks only at initialize(), and this rank reads its own values. (A block with the same
    modifier_rank r reads them too, but what it computes on this rank is replaced by rank r's at
    initialize(). Not an error: code that reads only the shape, as transformers'
    resize_token_embeddings does first, is right.)"""
    writer = stage.modifier_rank
    if writer is None or modifier_rank == writer or stage.stale_read:
        return
    rank = _torch_init.launch_rank()
    if rank is None or rank == writer:
        return
    stage.stale_read = True
    warnings.warn(
        f"GatheredParameters on rank {rank}: {stage.what} (shape {tuple(stage.shape)}, built "
        f"under Init) was changed on rank {writer} inside GatheredParameters(modifier_rank="
        f"{writer}) before initialize(); rank {rank} reads its own values, not rank {writer}'s, "
        f"until initialize() writes rank {writer}'s over every rank's (torch.distributed was not "
        "initialised, so the block's end could not broadcast them). Values computed from it here "
        f"differ from rank {writer}'s: initialise torch.distributed before building the model "
        "(deepspeed.init_distributed()), read it after initialize(), or change it inside "
        f"GatheredParameters(modifier_rank={writer}) only", RuntimeWarning, stacklevel=3)


def _in_engine_order(params: list) -> list:
    """The block's parameters with those of each engine in the engine's parameter order, the
    engines in the order they were made (the others first, in the block's order), so that every
    rank gathers and writes them in the same order whatever order it was given them in."""

    def key(param):
        engine = engine_of(param)
        if engine is None or _torch_init.staged(param) is not None:
            return (0, 0, 0)
        return (1, engine._serial, engine._position.get(id(param), -1))

    return sorted(params, key=key)


_BITS_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(values: torch.Tensor, entry: torch.Tensor) -> bool:
    """Whether two tensors hold the same bits (compared as integers: a NaN equals itself, and
    -0.0 differs from 0.0, as a digest of the bytes has them)."""
    if values.shape != entry.shape or values.dtype != entry.dtype:
        return False
    bits = _BITS_OF_SIZE[values.element_size()]
    return torch.equal(values.contiguous().view(bits), entry.contiguous().view(bits))


def _digest(param) -> bytes:
    """A digest of the parameter's bytes (one parameter at a time through host memory)."""
    values = param.detach()
    if values.device.type != "cpu":
        values = values.cpu()
    raw = values.contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(raw, digest_size=16).digest()


def _refuse_write_before_step(params):
    """Raises zinf.Error naming the first engine parameter whose engine has gradients reduced
    since its last step: a write then would be refused by the engine (or, with the step's
    optimizer pass running during the backward, the gather before it), so it is refused here
    with the reason, before anything is gathered."""
    for param in params:
        engine = engine_of(param)
        if engine is None or not engine._micro_batches_pending:
            continue
        name = engine._names[id(param)]
        raise _zinf.Error(
            f"failed_precondition: write_parameters('{name}'): gradients were reduced since the "
            "last step (GatheredParameters(modifier_rank=...) changes parameters between steps; "
            "call engine.step() first)")
