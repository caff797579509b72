"""zinf.torch.GatheredParameters (deepspeed.zero.GatheredParameters for zinf): full parameters
inside a `with` block, for reading or, with modifier_rank, changing them."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from . import _torch_init

if TYPE_CHECKING:
    from .torch import ZinfEngine


class GatheredParameters:
    """deepspeed.zero.GatheredParameters: inside the `with` block the given parameters hold
    their full values, for reading (exporting weights) or, with modifier_rank set, for changing
    them (a custom initialisation, loading weights):

        with zinf.torch.GatheredParameters(model.lm_head.parameters()):
            weights = model.lm_head.weight.detach().clone()
        with zinf.torch.GatheredParameters(model.lm_head.weight, modifier_rank=0):
            torch.nn.init.zeros_(model.lm_head.weight)

    - Parameters trained by a zinf engine: at stage 3 their engine modules are gathered for the
      block (at stages 1 and 2 they always are). With modifier_rank=r, each parameter changed in
      the block (in place, or its .data replaced) is written at its end into the engine's fp32
      master from rank r's values (Engine::write_parameters, which then republishes the
      parameters); the optimizer moments stay. Use it between steps (not after a backward whose
      step has not run); every rank must enter the block (the write is collective), and each
      write is a pass over the rank's master partition.
    - Parameters built under zinf.torch.Init and not yet given to initialize(): their staged
      values are read into them for the block and, with modifier_rank set, changes are written
      back to the staging file, so initialize() takes them.
    Other parameters are left as they are. Changes made without modifier_rank are not kept
    (at stage 3 they are lost at release; at stages 1 and 2 the next step overwrites them)."""

    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled: bool = True):
        self._params = [params] if isinstance(params, torch.Tensor) else list(params)
        self._modifier_rank = modifier_rank
        self._enabled = enabled
        self._held: list[tuple["ZinfEngine", str]] = []
        self._loaded: list[tuple[nn.Parameter, _torch_init.Staged]] = []
        # Engine parameters and how they looked on entry (version counter, data pointer).
        self._watched: list[tuple["ZinfEngine", nn.Parameter, int, int]] = []

    def __enter__(self):
        if not self._enabled:
            return self
        for param in self._params:
            stage = _torch_init.staged(param)
            if stage is not None:
                param.data = stage.load().to(stage.dtype)
                self._loaded.append((param, stage))
                continue
            ref = getattr(param, "_zinf_engine", None)
            engine = ref() if ref is not None else None
            if engine is None:
                continue
            if engine.stage == 3:
                owner = engine._owner[id(param)]
                engine._acquire(owner)
                self._held.append((engine, owner))
            if self._modifier_rank is not None:
                self._watched.append((engine, param, param._version, param.data_ptr()))
        return self

    def __exit__(self, *exc):
        # With several ranks every parameter is written (the write is collective, and only the
        # modifier rank's changes count, so the others cannot tell); with one, those changed.
        changed = []
        if exc[0] is None:
            for engine, param, version, ptr in self._watched:
                if (engine.world_size > 1 or param._version != version
                        or param.data_ptr() != ptr):
                    values = param.detach().to(dtype=torch.float32).contiguous().clone()
                    changed.append((engine, param, values))
        self._watched.clear()
        while self._held:
            engine, owner = self._held.pop()
            engine._release(owner)
        for engine, param, values in changed:
            engine._write_parameter(param, values, self._modifier_rank)
        while self._loaded:
            param, stage = self._loaded.pop()
            if self._modifier_rank is not None and exc[0] is None:
                stage.store(param.data)
            param.data = torch.empty(0, dtype=stage.dtype)
        return False
