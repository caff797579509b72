"""GatheredParameters(modifier_rank=0) on parameters an engine trains: changes made in the block
go into the engine's fp32 master (Engine::write_parameters) and training goes on from them, with
the optimizer moments as they were, exactly as torch does when the same change is made to its
parameters between the same steps."""
import json
import os

import pytest
import torch

import zinf.torch
from conftest import (BETAS, CLIP, EPS, LR, WEIGHT_DECAY, make_batches, make_mlp, make_model,
                      mlp_batches, mlp_config, mlp_loss, train_zinf, train_mlp_zinf, zinf_config)
from _helpers import mpirun, why_mpirun_unavailable


def change(model):
    """The change made between steps 3 and 4: a LayerNorm's weight set to a ramp and one block's
    MLP output projection scaled by a half (in place), the rest untouched."""
    ramp = torch.linspace(0.5, 1.5, model.transformer.ln_f.weight.numel())
    model.transformer.ln_f.weight.copy_(ramp)
    model.transformer.h[1].mlp.c_proj.weight.mul_(0.5)


@pytest.mark.parametrize("stage,offload", [(1, "none"), (2, "cpu"), (3, "nvme")])
def test_changes_in_the_block_reach_the_master_and_training_goes_on(stage, offload, tmp_path):
    batches = make_batches(6)
    reference = make_model()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                  weight_decay=WEIGHT_DECAY)
    expected_losses = []
    for step, (ids, labels) in enumerate(batches):
        if step == 3:
            with torch.no_grad():
                change(reference)
        loss = reference(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        expected_losses.append(loss.item())

    model = make_model()
    extra = {"stage3_param_persistence_threshold": 0} if stage == 3 else {}
    config = zinf_config(stage, offload, offload if stage == 3 else "none", tmp_path, **extra)
    engine, _, _, _ = zinf.torch.initialize(model=model, config=config)
    losses = train_zinf(engine, batches[:3])
    untouched_before = engine.read_parameter("transformer.h.0.mlp.c_fc.weight")
    with zinf.torch.GatheredParameters(model.parameters(), modifier_rank=0):
        with torch.no_grad():
            change(model)
    assert torch.equal(engine.read_parameter("transformer.ln_f.weight"),
                       torch.linspace(0.5, 1.5, 64))
    assert torch.equal(engine.read_parameter("transformer.h.0.mlp.c_fc.weight"), untouched_before)
    if stage == 3:
        assert all(p.numel() == 0 for p in model.parameters())
        assert engine.counters()["live_elements"] == 0
    losses += train_zinf(engine, batches[3:])
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    for name, expected in reference.named_parameters():
        got = engine.read_parameter(name)
        if name.endswith("attn.c_attn.bias"):
            got, expected = got[:64], expected[:64]  # test_oracle.key_bias
        assert ((got - expected).norm() / expected.norm()).item() < 1e-5, name


def test_a_write_while_gradients_wait_for_the_step_is_refused(tmp_path):
    model = make_model()
    engine, _, _, _ = zinf.torch.initialize(model=model, config=zinf_config(1, "none"))
    ids, labels = make_batches(1)[0]
    engine.backward(engine(input_ids=ids, labels=labels).loss)
    with pytest.raises(zinf.Error, match="write_parameters.*gradients were reduced"):
        with zinf.torch.GatheredParameters(model.transformer.ln_f.weight, modifier_rank=0):
            with torch.no_grad():
                model.transformer.ln_f.weight.fill_(2.0)
    engine.step()


@pytest.mark.parametrize("stage,offload", [(1, "none"), (2, "cpu"), (3, "cpu")])
def test_changes_made_through_data_are_written(stage, offload, tmp_path):
    """Ops on .data (the DeepSpeed idiom: p.data.copy_(w), as transformers' weight init does)
    do not move the version counter; they must be written all the same."""
    model = make_mlp()
    reference = make_mlp()
    engine, _, _, _ = zinf.torch.initialize(model=model, config=mlp_config(stage, offload,
                                                                           tmp_path))
    generator = torch.Generator().manual_seed(21)
    weight = torch.randn(16, 6, generator=generator)
    untouched = engine.read_parameter("3.weight")
    with zinf.torch.GatheredParameters(list(model.parameters()), modifier_rank=0):
        model[0].weight.data.copy_(weight)
        model[4].bias.data.mul_(0.5)
    with torch.no_grad():
        reference[0].weight.copy_(weight)
        reference[4].bias.mul_(0.5)
    assert torch.equal(engine.read_parameter("0.weight"), weight)
    assert torch.equal(engine.read_parameter("4.bias"), reference[4].bias.detach())
    assert torch.equal(engine.read_parameter("3.weight"), untouched)
    # The model computes with the written values.
    batch = mlp_batches(1)[0]
    assert torch.allclose(mlp_loss(engine, batch), mlp_loss(reference, batch), rtol=1e-6)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_write_at_stages_1_and_2_leaves_every_view_on_the_engines_copy(stage):
    """Stages 1 and 2: the engine's full device copy does not move when a block writes (its
    groups are rewritten in place), so only the block's own parameters need their views back:
    one whose .data the block replaced points at the engine's copy again, and every other keeps
    the memory it had. The module and the engine hold the written values (param.data, a
    forward, the fp32 masters), and training goes on from them as torch's does with the same
    change between the same steps, the optimizer moments kept."""
    model, reference = make_mlp(), make_mlp()
    engine, _, _, _ = zinf.torch.initialize(model=model, config=mlp_config(stage))
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                  weight_decay=WEIGHT_DECAY)

    def torch_step(batch):
        loss = mlp_loss(reference, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    try:
        batches = mlp_batches(5)
        losses = train_mlp_zinf(engine, batches[:2])
        expected_losses = [torch_step(batch) for batch in batches[:2]]
        views = {name: p.data_ptr() for name, p in model.named_parameters()}
        generator = torch.Generator().manual_seed(29)
        weight = torch.randn(16, 6, generator=generator)
        bias = torch.randn(16, generator=generator)
        untouched = engine.read_parameter("0.bias")
        # Parameters of three modules; 0.bias is in no block.
        with zinf.torch.GatheredParameters([model[4].weight, model[0].weight, model[3].bias],
                                           modifier_rank=0):
            model[0].weight.data.copy_(weight)
            model[3].bias.data = bias.clone()
            with torch.no_grad():
                model[4].weight.mul_(-0.5)
        with torch.no_grad():
            reference[0].weight.copy_(weight)
            reference[3].bias.copy_(bias)
            reference[4].weight.mul_(-0.5)
        assert {name: p.data_ptr() for name, p in model.named_parameters()} == views
        assert torch.equal(engine.read_parameter("0.weight"), weight)
        assert torch.equal(engine.read_parameter("3.bias"), bias)
        assert torch.equal(engine.read_parameter("0.bias"), untouched)
        for name, expected in reference.named_parameters():
            got = engine.read_parameter(name)
            assert torch.equal(model.get_parameter(name).detach(), got), name
            assert ((got - expected).norm() / expected.norm()).item() < 1e-5, name
        assert torch.allclose(mlp_loss(engine, batches[2]), mlp_loss(reference, batches[2]),
                              rtol=1e-5)
        losses += train_mlp_zinf(engine, batches[2:])
        expected_losses += [torch_step(batch) for batch in batches[2:]]
        assert losses == pytest.approx(expected_losses, rel=1e-5)
        assert {name: p.data_ptr() for name, p in model.named_parameters()} == views
        for name, expected in reference.named_parameters():
            got = engine.read_parameter(name)
            assert ((got - expected).norm() / expected.norm()).item() < 1e-5, name
            assert torch.equal(model.get_parameter(name).detach(), got), name
    finally:
        engine.destroy()


@pytest.mark.parametrize("stage", [1, 2])
def test_a_block_that_raises_on_one_rank_puts_a_replaced_view_back(stage):
    """One rank, stages 1 and 2: a block that raised writes nothing, and a parameter whose .data
    it replaced is the engine's memory again afterwards, with the engine's values (those it had
    before the block), as after a block that wrote."""
    model = make_mlp()
    engine, _, _, _ = zinf.torch.initialize(model=model, config=mlp_config(stage))
    try:
        train_mlp_zinf(engine, mlp_batches(1))
        views = {name: p.data_ptr() for name, p in model.named_parameters()}
        before = engine.read_parameter("0.weight")
        stray = torch.randn(16, 6, generator=torch.Generator().manual_seed(43))
        with pytest.raises(KeyError, match="raised in the block"):
            with zinf.torch.GatheredParameters([model[0].weight, model[4].bias],
                                               modifier_rank=0):
                model[0].weight.data = stray.to(model[0].weight.dtype)
                raise KeyError("raised in the block")
        assert {name: p.data_ptr() for name, p in model.named_parameters()} == views
        assert torch.equal(engine.read_parameter("0.weight"), before)
        assert torch.equal(model[0].weight.detach().float(), before)
    finally:
        engine.destroy()


@pytest.mark.parametrize("modifier_rank", [0, None])
def test_a_block_that_raises_at_stage_3_leaves_a_replaced_parameter_released(modifier_rank):
    """One rank, stage 3: a block that pointed a parameter's .data at a tensor of the script's
    and then raised writes nothing, and its release leaves that parameter as it leaves every
    other, an empty placeholder of the engine's dtype with nothing gathered, not on the script's
    tensor (which keeps its values); the next forward gathers the engine's values, those it had
    before the block, and training goes on from them."""
    model = make_mlp()
    config = mlp_config(3)
    # No prefetch: a release would otherwise gather the module the trace expects next, and
    # live_elements would not say whether the block's modules were given back.
    config["zero_optimization"]["stage3_prefetch_bucket_size"] = 0
    engine, _, _, _ = zinf.torch.initialize(model=model, config=config)
    try:
        batches = mlp_batches(3)
        train_mlp_zinf(engine, batches[:1])
        names = [name for name, _ in model.named_parameters()]
        before = {name: engine.read_parameter(name) for name in names}
        stray = torch.randn(16, 6, generator=torch.Generator().manual_seed(47))
        replaced = stray.clone()
        with pytest.raises(KeyError, match="raised in the block"):
            with zinf.torch.GatheredParameters([model[0].weight, model[4].bias],
                                               modifier_rank=modifier_rank):
                assert model[0].weight.numel() == 16 * 6
                model[0].weight.data = replaced
                raise KeyError("raised in the block")
        # The release empties every parameter's .data whatever it held, so these checks pass
        # even if the block's end skipped pointing the parameters back at the engine's views.
        for name, param in model.named_parameters():
            assert param.numel() == 0 and param.dtype == engine.dtype, name
        assert torch.equal(replaced, stray)
        assert engine.counters()["live_elements"] == 0
        # This is the check that catches a skipped swap back: the release forgets the gathered
        # view keyed by the storage the parameter holds when it is released, so a parameter
        # still on the script's tensor (or on the block's copy) there would leave the engine's
        # view of it registered.
        assert not engine._gathered_ptrs
        for name in names:
            assert torch.equal(engine.read_parameter(name), before[name]), name
        # The next forward computes with the engine's values: a torch model holding them gives
        # the same loss.
        reference = make_mlp()
        with torch.no_grad():
            for name, param in reference.named_parameters():
                param.copy_(before[name])
        with torch.no_grad():
            assert torch.allclose(mlp_loss(engine, batches[1]), mlp_loss(reference, batches[1]),
                                  rtol=1e-6)
        for name, param in model.named_parameters():
            assert param.numel() == 0, name
        # A block that reads sees them too, and training goes on from them.
        with zinf.torch.GatheredParameters(model[0].weight):
            assert torch.equal(model[0].weight.detach().float(), before["0.weight"])
        assert model[0].weight.numel() == 0
        train_mlp_zinf(engine, batches[1:])
        assert not torch.equal(engine.read_parameter("0.weight"), before["0.weight"])
    finally:
        engine.destroy()


def test_a_write_at_stage_2_on_two_ranks_leaves_every_view_on_the_engines_copy(two_rank_job):
    """Stage 2 on two ranks (mpirun; gathered_ranks.stage2_views): after a block whose end
    writes rank 0's change, and after one where rank 0 changed nothing, every parameter on both
    ranks is on the memory it had and holds the engine's values, including those whose .data
    rank 1 pointed elsewhere in the block (not written: only rank 0's changes count); both ranks
    then train alike."""
    sums = [(two_rank_job / f"stage2.rank{rank}").read_text() for rank in (0, 1)]
    assert sums[0] == sums[1], sums


@pytest.mark.parametrize("stage,offload", [(2, "cpu"), (3, "cpu")])
def test_a_write_before_the_step_names_the_parameter_with_offload(stage, offload, tmp_path):
    """With the optimizer state offloaded and no clipping, the step's optimizer pass runs during
    the backward; the refusal is still the documented one: it names the parameter and says to
    call step() first (not the gather's refusal, naming the module)."""
    model = make_mlp()
    config = mlp_config(stage, offload, tmp_path)
    config["gradient_clipping"] = 0.0
    engine, _, _, _ = zinf.torch.initialize(model=model, config=config)
    batches = mlp_batches(2)
    engine.backward(mlp_loss(engine, batches[0]))
    with pytest.raises(zinf.Error, match=r"failed_precondition: write_parameters\('4.weight'\): "
                                         r"gradients were reduced.*call (engine\.)?step\(\) "
                                         r"first"):
        with zinf.torch.GatheredParameters(model[4].weight, modifier_rank=0):
            model[4].weight.data.fill_(2.0)
    engine.step()
    # Nothing was written or left gathered: training goes on, and a write after the step works.
    train_mlp_zinf(engine, batches[1:])
    with zinf.torch.GatheredParameters(model[4].weight, modifier_rank=0):
        model[4].weight.data.fill_(2.0)
    assert torch.equal(engine.read_parameter("4.weight"), torch.full((3, 16), 2.0))


@pytest.mark.parametrize("stage", [1, 3])
def test_a_sign_flip_of_zeros_is_a_change(stage, tmp_path):
    """A change is a change of the bits: zeros set to -0.0 (equal as numbers) are written, and
    a bias holding NaN that the block leaves alone stays as it was."""
    model = make_mlp()
    engine, _, _, _ = zinf.torch.initialize(model=model, config=mlp_config(stage, "cpu",
                                                                           tmp_path))
    with zinf.torch.GatheredParameters(model[4].bias, modifier_rank=0):
        model[4].bias.data.fill_(0.0)
    assert torch.equal(engine.read_parameter("4.bias").view(torch.int32),
                       torch.zeros(3, dtype=torch.int32))
    with zinf.torch.GatheredParameters(model[4].bias, modifier_rank=0):
        model[4].bias.data.mul_(-1.0)
    assert torch.equal(engine.read_parameter("4.bias").view(torch.int32),
                       torch.full((3,), -2**31, dtype=torch.int32))
    nan_bias = torch.tensor([float("nan"), 1.0, 2.0] * 5 + [3.0])
    with zinf.torch.GatheredParameters(model[0].bias, modifier_rank=0):
        model[0].bias.data.copy_(nan_bias)
    with zinf.torch.GatheredParameters(list(model.parameters()), modifier_rank=0):
        pass
    assert torch.equal(engine.read_parameter("0.bias").view(torch.int32),
                       nan_bias.view(torch.int32))


@pytest.mark.skipif(why_mpirun_unavailable() is not None, reason=str(why_mpirun_unavailable()))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_whole_model_write_on_two_ranks_holds_the_model_twice_on_the_root(dtype, tmp_path):
    """GatheredParameters(model.parameters(), modifier_rank=0) at stage 3 on two ranks, halving
    every parameter of a model of 68 MB fp32 (gathered_memory.py write_all under mpirun): the
    root's peak RSS grows by the engine's gather and the block's copy (2x the gathered size, in
    the dtype the model computes in), not by a copy of what it writes (in bf16, converted to fp32
    one parameter at a time as the write reaches it, not all at once: 4x before); every rank then
    reads the halved values from the masters."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    result = mpirun("gathered_memory.py", [tmp_path, 512, 64, "write_all", dtype], timeout=300,
                    env=env, exported=["MALLOC_MMAP_THRESHOLD_"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reports = sorted((json.loads(line) for line in result.stdout.splitlines()
                      if line.startswith("{")), key=lambda r: r["rank"])
    print(json.dumps(reports))
    assert [r["rank"] for r in reports] == [0, 1]
    for report in reports:
        assert report["right"], report
        assert report["gathered_bytes"] == report["model_bytes"] // (2 if dtype == "bf16" else 1)
        assert report["peak_growth_bytes"] < 2.5 * report["gathered_bytes"], report


@pytest.fixture(scope="module")
def two_rank_job(tmp_path_factory):
    """gathered_ranks.py under mpirun (its stage-2 checks asserted on every rank, then its
    stage-3 scenarios): the folder of its files."""
    if why_mpirun_unavailable() is not None:
        pytest.skip(why_mpirun_unavailable())
    out = tmp_path_factory.mktemp("gathered_ranks")
    result = mpirun("gathered_ranks.py", [out], timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def two_rank_blocks(two_rank_job):
    """gathered_ranks.py's stage-3 scenarios: each rank's report, by rank."""
    return [torch.load(two_rank_job / f"gathered_ranks.rank{rank}.pt") for rank in (0, 1)]


def assert_bits(got, expected, what):
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), what


def assert_only_written(reports, scenario, name):
    """On every rank: `name`'s master holds rank 0's values as its bf16 block saw them, and
    every other master kept every bit."""
    values = reports[0][scenario]["set"].bfloat16().float()
    for rank, report in enumerate(reports):
        run = report[scenario]
        assert run["error"] is None, f"rank {rank}: {run['error']}"
        for other, before in run["before"].items():
            assert not torch.equal(before, before.bfloat16().float()), other  # not bf16 already
            expected = values if other == name else before
            assert_bits(run["after"][other], expected, f"{scenario}, rank {rank}: {other}")


def test_a_block_that_changes_nothing_on_two_ranks_keeps_every_master_bit(two_rank_blocks):
    """bf16 at stage 3: the block's values are the masters rounded to bf16, so writing them back
    would round every master."""
    for rank, report in enumerate(two_rank_blocks):
        run = report["noop"]
        assert run["error"] is None
        for name, before in run["before"].items():
            assert not torch.equal(before, before.bfloat16().float()), name  # not bf16 already
            assert_bits(run["after"][name], before, f"rank {rank}: {name}")


def test_only_the_parameter_changed_on_the_modifier_rank_is_written(two_rank_blocks):
    assert_only_written(two_rank_blocks, "one", "4.bias")


def test_ranks_may_list_the_parameters_in_different_orders(two_rank_blocks):
    assert_only_written(two_rank_blocks, "order", "0.bias")
    # The engine trains on afterwards, the ranks agreeing.
    trained = [report["order"]["trained"] for report in two_rank_blocks]
    for name, values in trained[0].items():
        assert not torch.equal(values, two_rank_blocks[0]["order"]["after"][name]), name
        assert_bits(trained[1][name], values, name)


def test_a_block_that_raises_on_another_rank_still_writes_the_modifier_ranks_changes(
        two_rank_blocks):
    """Every rank takes part in the block's end whatever happened in it, so none is left
    waiting: the block raised on rank 1, which still writes rank 0's change, then raises."""
    assert two_rank_blocks[1]["raise_other"]["error"] == "the block fails on rank 1"
    two_rank_blocks[1]["raise_other"]["error"] = None
    assert_only_written(two_rank_blocks, "raise_other", "3.weight")


def test_a_block_that_raises_on_the_modifier_rank_writes_nothing(two_rank_blocks):
    """As with one rank, a block that raises on the modifier rank keeps none of its changes, on
    any rank; the other ranks end it without an error."""
    assert [r["raise_root"]["error"] for r in two_rank_blocks] == [
        "the block fails on rank 0", None]
    for rank, report in enumerate(two_rank_blocks):
        for name, before in report["raise_root"]["before"].items():
            assert_bits(report["raise_root"]["after"][name], before, f"rank {rank}: {name}")


def test_a_parameter_given_another_shape_on_the_modifier_rank_is_refused_on_every_rank(
        two_rank_blocks):
    """Rank 0 points 4.bias at a tensor of another shape: every rank raises ValueError naming
    it, no master changes, and the engine trains on, the ranks agreeing."""
    for rank, report in enumerate(two_rank_blocks):
        run = report["reshape"]
        assert run["error"] is not None and run["error"].startswith("ValueError"), run["error"]
        assert "'4.bias'" in run["error"] and "another shape on rank 0" in run["error"]
        for name, before in run["before"].items():
            assert_bits(run["after"][name], before, f"rank {rank}: {name}")
    trained = [report["reshape"]["trained"] for report in two_rank_blocks]
    for name, values in trained[0].items():
        assert not torch.equal(values, two_rank_blocks[0]["reshape"]["after"][name]), name
        assert_bits(trained[1][name], values, name)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_parameter_given_another_shape_is_refused_and_training_goes_on(stage):
    """One rank: a parameter pointed at a tensor of another shape inside the block (the same
    elements transposed, too) is refused with ValueError naming it, nothing is written, and the
    engine trains on."""
    model = make_mlp()
    engine, _, _, _ = zinf.torch.initialize(model=model, config=mlp_config(stage))
    try:
        batches = mlp_batches(3)
        train_mlp_zinf(engine, batches[:1])
        weight = engine.read_parameter("0.weight")
        for replace in (lambda p: torch.randn(p.shape[0] + 1), lambda p: p.data.t().contiguous()):
            with pytest.raises(ValueError, match=r"'0\.weight' of shape \(16, 6\) was given "
                                                 r"another shape on rank 0"):
                with zinf.torch.GatheredParameters(model[0].weight, modifier_rank=0):
                    model[0].weight.data = replace(model[0].weight)
            assert torch.equal(engine.read_parameter("0.weight"), weight)
        train_mlp_zinf(engine, batches[1:])
        assert not torch.equal(engine.read_parameter("0.weight"), weight)
    finally:
        engine.destroy()


class _CountingDict(dict):
    """A dict that counts the entries walked through it (iteration, keys, values, items)."""

    walked = 0

    def _walk(self, entries):
        _CountingDict.walked += len(self)
        return entries

    def __iter__(self):
        return self._walk(super().__iter__())

    def keys(self):
        return self._walk(super().keys())

    def values(self):
        return self._walk(super().values())

    def items(self):
        return self._walk(super().items())


class _CountingList(list):
    """A list that counts the entries walked through it (iteration), into _CountingDict.walked."""

    def __iter__(self):
        _CountingDict.walked += len(self)
        return super().__iter__()


# The engine's per-parameter and per-module tables: none may be walked whole by a block.
_PER_PARAMETER_DICTS = ("_params", "_names", "_shapes", "_owner", "_position", "_owned",
                        "_gather_count")


@pytest.mark.parametrize("stage", [2, 3])
def test_a_block_per_parameter_does_not_walk_the_engines_parameters(stage):
    """A block per parameter after initialize() (as DeepSpeed-Chat's save_zero_three_model
    reads one at a time): the Python side of no block, reading or writing, walks the engine's
    per-parameter or per-module tables (its parameters, their names, shapes, owners, positions,
    the modules' parameters and gather counts), so the package adds work linear in the block's
    parameters, not the model's (gathered_loop_bench.py times such loops); at stage 2 a writing
    block refreshes the views of its own parameters only. A writing block still costs the
    engine's write of its parameters' groups, which this does not count."""
    generator = torch.Generator().manual_seed(31)
    model = torch.nn.ModuleList(torch.nn.Linear(3, 2) for _ in range(40))
    engine, _, _, _ = zinf.torch.initialize(model=model, config=mlp_config(stage))
    try:
        views = [layer.weight.data_ptr() for layer in model]
        for table in _PER_PARAMETER_DICTS:
            setattr(engine, table, _CountingDict(getattr(engine, table)))
        engine._param_ids = _CountingList(engine._param_ids)
        _CountingDict.walked = 0
        for index, layer in enumerate(model):
            with zinf.torch.GatheredParameters(layer.bias):
                pass
            with zinf.torch.GatheredParameters([layer.bias, layer.weight], modifier_rank=0):
                values = torch.randn(2, 3, generator=generator) if index % 2 == 0 else None
                if index % 4 == 0:
                    with torch.no_grad():
                        layer.weight.copy_(values)
                elif index % 4 == 2:
                    # Replaced: at stages 1 and 2 the weight is on the engine's copy afterwards
                    # only where the block's end points it back there.
                    layer.weight.data = values.to(layer.weight.dtype)
        walked = _CountingDict.walked
        for table in _PER_PARAMETER_DICTS:
            setattr(engine, table, dict(getattr(engine, table)))
        engine._param_ids = list(engine._param_ids)
        assert walked == 0
        # The writes landed, in the engine and in the module.
        reread = torch.Generator().manual_seed(31)
        for index in range(0, 40, 2):
            written = torch.randn(2, 3, generator=reread)
            assert torch.equal(engine.read_parameter(f"{index}.weight"), written), index
            if stage < 3:
                assert model[index].weight.data_ptr() == views[index], index
                assert torch.equal(model[index].weight.detach(), written), index
    finally:
        engine.destroy()
