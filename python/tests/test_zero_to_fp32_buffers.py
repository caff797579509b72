"""DeepSpeed's zero_to_fp32 functions and script give the model's persistent buffers with its
weights (deepspeed/utils/zero_to_fp32.py adds the buffers of the module state to the fp32 state
dict): a BatchNorm model trained at stage 2, saved, and loaded into a fresh model through
get_fp32_state_dict_from_zero_checkpoint, load_state_dict_from_zero_checkpoint and the
zero_to_fp32.py script has the engine's running statistics and gives the engine's eval output.
The state dict and the script's files hold the floating buffers in fp32, from an engine that
computes in fp32 or bf16, and num_batches_tracked in int64, its dtype, before any model is
loaded from them (load_state_dict would cast each into the model's dtype)."""
import pytest
import torch
from torch import nn

import zinf.torch
import zinf.zero_to_fp32 as zero_to_fp32

BUFFERS = ["1.running_mean", "1.running_var", "1.num_batches_tracked"]


def make_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def trained(request, tmp_path_factory):
    """(engine, checkpoint directory, the engine's buffers, an eval batch, the engine's eval
    output) after 3 steps on batches far from BatchNorm's initial statistics (mean 1, std 3),
    computing in fp32 or bf16 (where the engine's running statistics are bf16)."""
    dtype = request.param
    config = {"train_micro_batch_size_per_gpu": 16, "zinf": {"cpu_threads": 1},
              "bf16": {"enabled": dtype == torch.bfloat16},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 2}}
    engine, _, _, _ = zinf.torch.initialize(model=make_model(0), config=config)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = (torch.randn(16, 8, generator=generator) * 3 + 1).to(dtype)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    save_dir = tmp_path_factory.mktemp("bn")
    engine.save_checkpoint(str(save_dir))
    buffers = {name: b.clone() for name, b in engine.module.state_dict().items()
               if name in BUFFERS}
    assert buffers["1.num_batches_tracked"].item() == 3
    assert buffers["1.num_batches_tracked"].dtype == torch.int64
    assert buffers["1.running_mean"].dtype == dtype
    assert buffers["1.running_mean"].abs().max() > 0.05  # moved from BatchNorm's zeros
    engine.eval()
    x = (torch.randn(4, 8, generator=generator) * 3 + 1).to(dtype)
    with torch.no_grad():
        out = engine(x).detach().clone()
    return engine, str(save_dir), buffers, x, out


def assert_holds_the_engines_buffers(weights, trained):
    """The state dict or file as read, before a model casts it: each buffer the engine's value,
    a floating one in fp32 (the engine's bf16 converted exactly) and num_batches_tracked in
    int64."""
    buffers = trained[2]
    assert sorted(set(weights) & set(BUFFERS)) == sorted(BUFFERS)
    for name, value in buffers.items():
        want_dtype = torch.float32 if value.is_floating_point() else value.dtype
        assert weights[name].dtype == want_dtype, (name, weights[name].dtype)
        assert torch.equal(weights[name], value.to(want_dtype)), name
    assert weights["1.num_batches_tracked"].dtype == torch.int64
    assert weights["1.running_mean"].dtype == torch.float32


def assert_is_the_engines(model, trained):
    """`model` (fp32, loaded from the fp32 weights) has the engine's parameters; in the engine's
    dtype it has the engine's buffers and gives its eval output."""
    engine, _, buffers, x, out = trained
    for name, _ in model.named_parameters():
        assert torch.equal(model.state_dict()[name], engine.read_parameter(name)), name
    model.to(x.dtype)
    state = model.state_dict()
    for name, value in buffers.items():
        assert state[name].dtype == value.dtype, name
        assert torch.equal(state[name], value), name
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x), out)


@pytest.mark.parametrize("lazy_mode", [False, True])
def test_get_fp32_state_dict_holds_the_buffers(trained, lazy_mode):
    _, save_dir, buffers, _, _ = trained
    weights = zinf.torch.get_fp32_state_dict_from_zero_checkpoint(save_dir, lazy_mode=lazy_mode)
    if lazy_mode:
        for name, value in buffers.items():
            want_dtype = torch.float32 if value.is_floating_point() else value.dtype
            assert weights[name].dtype == want_dtype and weights[name].shape == value.shape
            assert weights[name].element_size() == want_dtype.itemsize, name
        weights = {name: weight.contiguous() for name, weight in weights.items()}
    assert_holds_the_engines_buffers(weights, trained)
    fresh = make_model(5)
    fresh.load_state_dict(weights, strict=True)
    assert_is_the_engines(fresh, trained)
    # Leaving out the frozen parameters (there are none) keeps the buffers, as DeepSpeed's.
    kept = zinf.torch.get_fp32_state_dict_from_zero_checkpoint(save_dir,
                                                                exclude_frozen_parameters=True)
    assert sorted(kept) == sorted(weights)
    assert_holds_the_engines_buffers(kept, trained)


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
    assert_holds_the_engines_buffers(weights, trained)
    fresh = make_model(5)
    fresh.load_state_dict(weights, strict=True)
    assert_is_the_engines(fresh, trained)
