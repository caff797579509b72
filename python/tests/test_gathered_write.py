"""GatheredParameters(modifier_rank=0) on parameters an engine trains: changes made in the block
go into the engine's fp32 master (Engine::write_parameters) and training goes on from them, with
the optimizer moments as they were, exactly as torch does when the same change is made to its
parameters between the same steps."""
import pytest
import torch

import zinf.torch
from conftest import (BETAS, CLIP, EPS, LR, WEIGHT_DECAY, make_batches, make_mlp, make_model,
                      mlp_batches, mlp_config, mlp_loss, train_zinf, train_mlp_zinf, zinf_config)


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
