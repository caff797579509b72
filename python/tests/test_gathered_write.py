"""GatheredParameters(modifier_rank=0) on parameters an engine trains: changes made in the block
go into the engine's fp32 master (Engine::write_parameters) and training goes on from them, with
the optimizer moments as they were, exactly as torch does when the same change is made to its
parameters between the same steps."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import zinf.torch
from conftest import (BETAS, CLIP, EPS, LR, WEIGHT_DECAY, make_batches, make_mlp, make_model,
                      mlp_batches, mlp_config, mlp_loss, train_zinf, train_mlp_zinf, zinf_config)

HERE = os.path.dirname(os.path.abspath(__file__))


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


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun on PATH")
def test_a_whole_model_write_on_two_ranks_holds_the_model_twice_on_the_root(tmp_path):
    """GatheredParameters(model.parameters(), modifier_rank=0) at stage 3 on two ranks, over a
    model of 68 MB fp32 (gathered_memory.py under mpirun): the root's peak RSS grows by the
    engine's gather and the block's copy (2x the model), not by a third copy of what it writes;
    every rank then reads the written bias from the master."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    command = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-x",
               "MALLOC_MMAP_THRESHOLD_", "-np", "2", sys.executable,
               os.path.join(HERE, "gathered_memory.py"), str(tmp_path), "512", "64",
               "write_one"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reports = sorted((json.loads(line) for line in result.stdout.splitlines()
                      if line.startswith("{")), key=lambda r: r["rank"])
    print(json.dumps(reports))
    assert [r["rank"] for r in reports] == [0, 1]
    for report in reports:
        assert report["right"], report
        assert report["peak_growth_bytes"] < 2.5 * report["model_bytes"], report
