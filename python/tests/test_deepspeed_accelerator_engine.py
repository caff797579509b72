"""DeepSpeed's CPU accelerator and engine attributes that ported code reads
(deepspeed/accelerator/cpu_accelerator.py, deepspeed/runtime/engine.py):
get_accelerator().device() is None, get_accelerator().current_device() is LOCAL_RANK (0 when
unset; a value that is no rank is refused naming the variable), and engine.client_optimizer is
the optimizer object given to deepspeed.initialize, None when the config's section made it."""
import pytest
import torch

import zinf.deepspeed_compat as compat
from conftest import make_mlp, mlp_batches, mlp_loss


def test_the_accelerator_has_no_device_object():
    accelerator = compat.get_accelerator()
    assert accelerator.device() is None
    assert accelerator.device(0) is None
    assert accelerator.device_name() == "cpu"


def test_current_device_is_local_rank(monkeypatch):
    accelerator = compat.get_accelerator()
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert accelerator.current_device() == 0
    for rank in (3, 0, 12):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        assert accelerator.current_device() == rank
    monkeypatch.setenv("LOCAL_RANK", "one")
    with pytest.raises(ValueError, match="current_device\\(\\): LOCAL_RANK is 'one', not a "
                                         "process's rank on its machine"):
        accelerator.current_device()


CONFIG = {"train_micro_batch_size_per_gpu": 4, "zinf": {"cpu_threads": 1},
          "zero_optimization": {"stage": 2}}


def test_engine_client_optimizer_is_the_object_given():
    model = make_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, returned, _, _ = compat.initialize(model=model, optimizer=optimizer,
                                               config=dict(CONFIG), dist_init_required=False)
    try:
        assert engine.client_optimizer is optimizer
        assert returned is not optimizer  # the engine's own, as DeepSpeed returns its wrapper
        engine.backward(mlp_loss(engine, mlp_batches(1)[0]))
        engine.step()
        assert engine.client_optimizer is optimizer
    finally:
        engine.destroy()


def test_engine_client_optimizer_is_none_without_one():
    config = {**CONFIG, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, _, _, _ = compat.initialize(model=make_mlp(), config=config,
                                        dist_init_required=False)
    try:
        assert engine.client_optimizer is None
    finally:
        engine.destroy()
