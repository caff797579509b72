"""ZeRO-3 model construction as DeepSpeed scripts use it: nested zinf.torch.Init blocks (Hugging
Face's from_pretrained opens one inside a script's) build the model a single block builds, and a tensor taken inside GatheredParameters keeps its values."""
import os

import pytest
import torch
from torch import nn

import zinf.torch
from init_model import Stack, batch, config

HERE = os.path.dirname(os.path.abspath(__file__))


def staged_values(model):
    with zinf.torch.GatheredParameters(list(model.parameters())):
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_nested_init_blocks_build_the_model_a_single_block_builds(tmp_path):
    outer_dir, inner_dir = tmp_path / "outer", tmp_path / "inner"
    torch.manual_seed(4)
    with zinf.torch.Init(config=config(outer_dir, 16)) as single:
        expected_model = Stack(16, 2)
    expected = staged_values(expected_model)

    torch.manual_seed(4)
    with zinf.torch.Init(config=config(outer_dir, 16)) as outer:
        # Another config (another staging directory) inside: the outer block's is used.
        with zinf.torch.Init(config=config(inner_dir, 16, stage=1)) as inner:
            with zinf.torch.Init(enabled=False):
                model = Stack(16, 2)
        # The inner block's end leaves the outer one staging.
        late = nn.Linear(4, 4)
    assert late.weight.numel() == 0
    assert nn.Linear(4, 4).weight.numel() == 16  # constructors restored after the outer block
    # Each parameter staged once, into the outer block's file.
    assert inner.staged_bytes == single.staged_bytes
    assert outer.staged_bytes == single.staged_bytes + 4 * (16 + 4)
    files = {zinf.torch._torch_init.staged(p).file for p in model.parameters()}
    assert files == {outer._file} and inner._file is None
    assert all(p.numel() == 0 for p in model.parameters())
    got = staged_values(model)
    for name, values in expected.items():
        assert torch.equal(got[name], values), name

    cfg = config(outer_dir, 16)
    engine, _, _, _ = zinf.torch.initialize(model=model, config=cfg)
    for name, values in expected.items():
        assert torch.equal(engine.read_parameter(name), values), name
    ids, labels = batch(1)
    loss = engine(ids, labels)
    torch.manual_seed(4)
    assert loss.item() == pytest.approx(Stack(16, 2)(ids, labels).item(), rel=1e-6)


def test_a_block_entered_again_inside_itself_stages_until_its_outer_exit(tmp_path):
    block = zinf.torch.Init(config=config(tmp_path, 16))
    with block:
        with block:
            first = nn.Linear(8, 8)
        second = nn.Linear(8, 8)
    assert first.weight.numel() == 0 and second.weight.numel() == 0
    assert block.staged_bytes == 2 * 4 * (64 + 8)
    assert nn.Linear(8, 8).weight.numel() == 64


def test_a_tensor_taken_inside_gathered_parameters_keeps_its_values(tmp_path):
    # Three layers live at most: the memory of a released module's gather is reused by the next.
    cfg = config(tmp_path, 32, offload="none", stage3_max_live_parameters=2000)
    torch.manual_seed(8)
    with zinf.torch.Init(config=cfg):
        model = Stack(32, 3)
    engine, _, _, _ = zinf.torch.initialize(model=model, config=cfg)
    loss = engine(*batch(3))
    engine.backward(loss)
    engine.step()
    kept = {}
    for name, p in model.named_parameters():
        with zinf.torch.GatheredParameters([p]):
            kept[name] = p.data.cpu()
    for name, values in kept.items():
        assert torch.equal(values, engine.read_parameter(name)), name
    # Gathered by a forward when the block starts: the block reads the forward's gather.
    seen = {}

    def read_in_forward(module, args):
        with zinf.torch.GatheredParameters([module.weight]):
            seen["weight"] = module.weight.detach().clone()

    model.head.register_forward_pre_hook(read_in_forward)
    engine(*batch(4))
    assert torch.equal(seen["weight"], engine.read_parameter("head.weight"))
    assert engine.counters()["live_elements"] == 0
