"""DeepSpeed's zero_to_fp32 functions and script give the model's persistent buffers with its
weights (deepspeed/utils/zero_to_fp32.py adds the buffers of the module state to the fp32 state
dict): a BatchNorm model trained at stage 2, saved, and loaded into a fresh model through
get_fp32_state_dict_from_zero_checkpoint, load_state_dict_from_zero_checkpoint and the
zero_to_fp32.py script has the engine's running statistics and gives the engine's eval output."""
import pytest
import torch
from torch import nn

import zinf.torch
import zinf.zero_to_fp32 as zero_to_fp32

BUFFERS = ["1.running_mean", "1.running_var", "1.num_batches_tracked"]


def make_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(engine, checkpoint directory, the engine's buffers, an eval batch, the engine's eval
    output) after 3 steps on batches far from BatchNorm's initial statistics (mean 1, std 3)."""
    config = {"train_micro_batch_size_per_gpu": 16, "zinf": {"cpu_threads": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 2}}
    engine, _, _, _ = zinf.torch.initialize(model=make_model(0), config=config)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(16, 8, generator=generator) * 3 + 1
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    save_dir = tmp_path_factory.mktemp("bn")
    engine.save_checkpoint(str(save_dir))
    buffers = {name: b.clone() for name, b in engine.module.state_dict().items()
               if name in BUFFERS}
    assert buffers["1.num_batches_tracked"].item() == 3
    assert buffers["1.running_mean"].abs().max() > 0.05  # moved from BatchNorm's zeros
    engine.eval()
    x = torch.randn(4, 8, generator=generator) * 3 + 1
    with torch.no_grad():
        out = engine(x).detach().clone()
    return engine, str(save_dir), buffers, x, out


def assert_is_the_engines(model, trained):
    engine, _, buffers, x, out = trained
    state = model.state_dict()
    for name, value in buffers.items():
        assert state[name].dtype == value.dtype, name
        assert torch.equal(state[name], value), name
    for name, _ in model.named_parameters():
        assert torch.equal(state[name], engine.read_parameter(name)), name
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x), out)


@pytest.mark.parametrize("lazy_mode", [False, True])
def test_get_fp32_state_dict_holds_the_buffers(trained, lazy_mode):
    _, save_dir, buffers, _, _ = trained
    weights = zinf.torch.get_fp32_state_dict_from_zero_checkpoint(save_dir, lazy_mode=lazy_mode)
    if lazy_mode:
        for name, value in buffers.items():
            assert weights[name].dtype == value.dtype and weights[name].shape == value.shape
            assert weights[name].element_size() == value.element_size(), name
        weights = {name: weight.contiguous() for name, weight in weights.items()}
    assert sorted(set(weights) & set(BUFFERS)) == sorted(BUFFERS)
    fresh = make_model(5)
    fresh.load_state_dict(weights, strict=True)
    assert_is_the_engines(fresh, trained)
    # Leaving out the frozen parameters (there are none) keeps the buffers, as DeepSpeed's.
    kept = zinf.torch.get_fp32_state_dict_from_zero_checkpoint(save_dir,
                                                                exclude_frozen_parameters=True)
    assert sorted(kept) == sorted(weights)


def test_load_state_dict_from_zero_checkpoint_loads_the_buffers(trained):
    fresh = make_model(5)
    zinf.torch.load_state_dict_from_zero_checkpoint(fresh, trained[1])
    assert_is_the_engines(fresh, trained)


@pytest.mark.parametrize("safe", [False, True])
def test_the_zero_to_fp32_script_writes_the_buffers(trained, tmp_path, safe):
    _, save_dir, _, _, _ = trained
    assert zero_to_fp32.main([save_dir, str(tmp_path)] +
                             (["--safe_serialization"] if safe else [])) == 0
    if safe:
        from safetensors.torch import load_file
        weights = load_file(str(tmp_path / "model.safetensors"))
    else:
        weights = torch.load(str(tmp_path / "pytorch_model.bin"), weights_only=True)
    fresh = make_model(5)
    fresh.load_state_dict(weights, strict=True)
    assert_is_the_engines(fresh, trained)
