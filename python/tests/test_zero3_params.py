"""ZeRO-3 model construction as DeepSpeed scripts use it: nested zinf.torch.Init blocks (Hugging
Face's from_pretrained opens one inside a script's) build the model a single block builds, and
stage-3 parameters carry DeepSpeed's ds_id, ds_shape, ds_numel and ds_status, with which
DeepSpeed-Chat's save_zero_three_model saves the trained values (zero3_save_run.py)."""
import copy
import io
import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch
from torch import nn

import zinf.torch
from _helpers import mpirun, why_mpirun_unavailable
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


def test_a_block_that_failed_to_open_leaves_later_blocks_working(tmp_path):
    """A block whose staging directory cannot be made raises from __enter__, which gets no
    __exit__: it must not stay the block later ones join (they would then stage nothing and
    build the model whole)."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError):
        with zinf.torch.Init(config=config(tmp_path, 16), staging_dir=str(blocker / "staging")):
            pass
    with zinf.torch.Init(config=config(tmp_path, 16)) as block:
        layer = nn.Linear(8, 8)
    assert layer.weight.numel() == 0
    assert block.staged_bytes == 4 * (64 + 8)


def test_a_block_entered_again_inside_itself_stages_until_its_outer_exit(tmp_path):
    block = zinf.torch.Init(config=config(tmp_path, 16))
    with block:
        with block:
            first = nn.Linear(8, 8)
        second = nn.Linear(8, 8)
    assert first.weight.numel() == 0 and second.weight.numel() == 0
    assert block.staged_bytes == 2 * 4 * (64 + 8)
    assert nn.Linear(8, 8).weight.numel() == 64


def test_init_takes_deepspeeds_arguments_in_their_order(tmp_path):
    """DeepSpeed's zero.Init(module, data_parallel_group, mem_efficient_linear, remote_device,
    pin_memory, config_dict_or_path, config, enabled, dtype, mpu, ...): a positional call means
    the same with zinf's. Before, the second positional argument was taken for the config, and
    a call that passed the config sixth raised TypeError."""
    cfg = config(tmp_path / "staging", 16)
    block = zinf.torch.Init(None, None, True, "cpu", False, cfg)
    assert block.staging_dir == str(tmp_path / "staging")
    with block:
        layer = nn.Linear(8, 8)
    assert layer.weight.numel() == 0 and block.staged_bytes == 4 * (64 + 8)
    # enabled is the eighth: False builds modules as usual.
    with zinf.torch.Init(None, None, True, None, False, cfg, None, False) as disabled:
        assert nn.Linear(8, 8).weight.numel() == 64
    assert disabled.staged_bytes == 0
    # A process group in data_parallel_group's place is not read as a config.
    assert zinf.torch.Init(None, object()).staging_dir == tempfile.gettempdir()


def test_stage3_parameters_carry_deepspeeds_attributes(tmp_path):
    cfg = config(tmp_path, 16, offload="none")
    torch.manual_seed(6)
    with zinf.torch.Init(config=cfg):
        model = Stack(16, 2)
    model.extra = nn.Linear(16, 16)  # built outside Init: it gets them at initialize()
    model.extra.requires_grad_(False)
    params = dict(model.named_parameters())
    staged = {name: p for name, p in params.items() if not name.startswith("extra.")}
    ids = {name: p.ds_id for name, p in staged.items()}
    assert len(set(ids.values())) == len(ids) and all(type(i) is int for i in ids.values())
    assert not hasattr(params["extra.weight"], "ds_id")
    assert type(copy.deepcopy(model.head).weight) is nn.Parameter  # a copy is not zinf's
    for name, p in staged.items():
        assert p.ds_status.name == "NOT_AVAILABLE", name
    assert params["embed.weight"].ds_shape == torch.Size([256, 16])
    assert params["embed.weight"].ds_numel == 256 * 16
    with zinf.torch.GatheredParameters([params["head.weight"]]):
        assert params["head.weight"].ds_status.name == "AVAILABLE"
        assert params["head.bias"].ds_status.name == "NOT_AVAILABLE"
    assert params["head.weight"].ds_status.name == "NOT_AVAILABLE"

    engine, _, _, _ = zinf.torch.initialize(model=model, config=cfg)
    assert {name: p.ds_id for name, p in staged.items()} == ids  # kept at initialize()
    extra = params["extra.weight"]
    assert extra.ds_shape == torch.Size([16, 16]) and extra.ds_numel == 256
    assert extra.ds_id not in ids.values()
    assert isinstance(extra, nn.Parameter)
    seen = {}
    model.head.register_forward_pre_hook(
        lambda module, args: seen.update(during=module.weight.ds_status.name))
    loss = engine(*batch(2))
    assert seen["during"] == "AVAILABLE"
    engine.backward(loss)
    engine.step()
    for name, p in params.items():
        assert p.ds_status.name == "NOT_AVAILABLE", name
        assert p.numel() == 0
    with zinf.torch.GatheredParameters(model.head.parameters()):
        assert model.head.weight.ds_status.name == "AVAILABLE"
        assert model.head.weight.shape == model.head.weight.ds_shape

    # The placeholders pickle without zinf's link to the engine.
    buffer = io.BytesIO()
    torch.save({"w": model.head.weight, "c": model.head.weight.cpu()}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded["w"].numel() == 0 and type(loaded["w"]) is nn.Parameter


def test_below_stage3_a_model_built_under_init_has_plain_parameters(tmp_path):
    cfg = config(tmp_path, 16, stage=1, offload="none")
    with zinf.torch.Init(config=cfg):
        model = Stack(16, 2)
    assert all(hasattr(p, "ds_id") for p in model.parameters())
    zinf.torch.initialize(model=model, config=cfg)
    for name, p in model.named_parameters():
        assert type(p) is nn.Parameter and not hasattr(p, "ds_id"), name
        assert not hasattr(p, "ds_status") and p.numel() > 0, name


def check_saved(out, ranks):
    with open(os.path.join(out, "save.rank0.json")) as f:
        report = json.load(f)
    names = sorted(report["diff"])
    assert report["saved"] == names and len(names) == 9
    for name in names:
        assert report["diff"][name] == 0.0, name  # the trained fp32 master, bit for bit
        assert report["moved"][name] > 1e-3, name
    assert set(report["status"]) == {"NOT_AVAILABLE"}
    assert report["status_gathered"] == "AVAILABLE"
    assert len(set(report["ids"])) == 9
    for rank in range(1, ranks):
        with open(os.path.join(out, f"save.rank{rank}.json")) as f:
            assert json.load(f)["ids"] == report["ids"]  # the same ids on every rank


def test_deepspeed_chats_zero3_save_writes_the_trained_values(tmp_path):
    result = subprocess.run([sys.executable, os.path.join(HERE, "zero3_save_run.py"),
                             str(tmp_path)], capture_output=True, text=True, timeout=300,
                            cwd=HERE)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    check_saved(tmp_path, 1)


@pytest.mark.skipif(why_mpirun_unavailable() is not None, reason=str(why_mpirun_unavailable()))
def test_deepspeed_chats_zero3_save_writes_the_trained_values_from_two_ranks(two_rank_job):
    check_saved(two_rank_job / "save", 2)


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


STALE_READ = """
import os, sys, warnings, torch, zinf.torch
rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
torch.manual_seed(5)
with zinf.torch.Init():
    layer = torch.nn.Linear(6, 3)
with zinf.torch.GatheredParameters([layer.weight], modifier_rank=0):
    if rank == 0:
        layer.weight.data.fill_(0.5)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with zinf.torch.GatheredParameters([layer.weight], modifier_rank=0):
        pass  # what it computes on rank 1 is replaced by rank 0's: no warning
    with zinf.torch.GatheredParameters([layer.weight, layer.bias]):
        seen = layer.weight.detach().clone()
    with zinf.torch.GatheredParameters([layer.weight]):
        pass  # warned once
# Each rank's outcome in a file of its own: mpirun's forwarded stdout can merge or drop the
# ranks' last lines at exit.
with open(os.path.join(sys.argv[1], f"rank{rank}"), "w") as out:
    print(rank, len(caught), torch.equal(seen, torch.full((3, 6), 0.5)), file=out)
    for w in caught:
        print("WARNING", w.category.__name__, w.message, file=out)
"""
# The two-rank job: STALE_READ (before any initialize() of the process), then, its layer
# released, zero3_save_run.py's training and save, as `mpirun -np 2 python zero3_save_run.py`.
TWO_RANK_JOB = STALE_READ + """
del layer, seen
import gc
gc.collect()
import zero3_save_run
zero3_save_run.main(sys.argv[2])
"""


@pytest.fixture(scope="module")
def two_rank_job(tmp_path_factory):
    """One mpirun job of 2 ranks for the tests below: ROOT/stale holds STALE_READ's outcome,
    ROOT/save zero3_save_run.py's."""
    if why_mpirun_unavailable() is not None:
        pytest.skip(why_mpirun_unavailable())
    root = tmp_path_factory.mktemp("zero3_two_ranks")
    (root / "stale").mkdir()
    (root / "save").mkdir()
    result = mpirun("-c", [TWO_RANK_JOB, root / "stale", root / "save"], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return root


@pytest.mark.skipif(why_mpirun_unavailable() is not None, reason=str(why_mpirun_unavailable()))
def test_a_rank_reading_another_ranks_change_before_initialize_is_warned(two_rank_job):
    lines = [line for rank in (0, 1)
             for line in (two_rank_job / "stale" / f"rank{rank}").read_text().splitlines()]
    assert "0 0 True" in lines and "1 1 False" in lines, lines
    warned = [line for line in lines if line.startswith("WARNING")]
    assert len(warned) == 1 and warned[0].startswith(
        "WARNING RuntimeWarning GatheredParameters on rank 1: Linear.weight (shape (3, 6), built "
        "under Init) was changed on rank 0 inside GatheredParameters(modifier_rank=0) before "
        "initialize(); rank 1 reads its own values, not rank 0's"), warned
