"""torch parameter groups as engine groups: the usual decay / no-decay split (weight decay 0 for
biases and LayerNorm weights) and a group with its own learning rate, under a scheduler, against
torch.optim.AdamW with the same groups."""
import pytest
import torch

import zinf.torch
from conftest import BETAS, EPS, LR, make_batches, make_model, train_torch, train_zinf, zinf_config

STEPS = 12


def grouped(model):
    """Matrices decay by 0.1; biases and LayerNorm weights do not, at twice the learning rate."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0, "lr": 2 * LR}]


def warmup(step):
    return min(1.0, (step + 1) / 5)


def torch_run(batches):
    model = make_model()
    optimizer = torch.optim.AdamW(grouped(model), lr=LR, betas=BETAS, eps=EPS)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    losses = train_torch(model, optimizer, batches, scheduler=scheduler)
    return losses, dict(model.named_parameters())


@pytest.mark.parametrize("stage,offload", [(1, "none"), (3, "cpu")])
def test_groups_match_torch_adamw(stage, offload, tmp_path):
    batches = make_batches(STEPS)
    expected_losses, expected = torch_run(batches)
    model = make_model()
    extra = {"stage3_param_persistence_threshold": 0} if stage == 3 else {}
    config = zinf_config(stage, offload, offload if stage == 3 else "none", tmp_path, **extra)
    engine, optimizer, _, scheduler = zinf.torch.initialize(
        model=model, config=config, model_parameters=grouped(model),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warmup))
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    losses = train_zinf(engine, batches)
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    assert engine.get_lr() == pytest.approx([LR, 2 * LR])
    worst = 0.0
    for name, reference in expected.items():
        got = engine.read_parameter(name)
        if name.endswith("attn.c_attn.bias"):
            # The key bias's gradient is rounding noise (test_oracle.key_bias).
            got, reference = got[:64], reference[:64]
        worst = max(worst, ((got - reference).norm() / reference.norm()).item())
    print(f"stage {stage} {offload}, two groups: worst parameter's relative error {worst:.2e}")
    assert worst < 1e-5


def test_a_single_decay_for_all_would_differ(tmp_path):
    """The groups matter: with the config's weight decay for every parameter, the biases end
    elsewhere (so the test above checks that each group got its own)."""
    batches = make_batches(STEPS)
    _, expected = torch_run(batches)
    model = make_model()
    config = zinf_config(1, "none", "none", tmp_path)
    engine, _, _, _ = zinf.torch.initialize(
        model=model, config=config, model_parameters=model.parameters(),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warmup))
    train_zinf(engine, batches)
    name = "transformer.ln_f.bias"
    got = engine.read_parameter(name)
    assert ((got - expected[name]).norm() / expected[name].norm()).item() > 1e-3


def test_groups_that_change_betas_are_refused(tmp_path):
    model = make_model()
    groups = grouped(model)
    groups[1]["betas"] = (0.8, 0.9)
    with pytest.raises(NotImplementedError, match="parameter group 1: betas"):
        zinf.torch.initialize(model=model, config=zinf_config(1, "none", "none", tmp_path),
                              model_parameters=groups)


@pytest.mark.parametrize("initialize", ["zinf.torch", "deepspeed"])
def test_a_group_asking_for_amsgrad_is_refused_naming_it(initialize, tmp_path):
    # The engine's Adam keeps no maximum of the second moments: "amsgrad": True in a group is
    # refused, as the config's optimizer.params.amsgrad true is, where it was accepted and then
    # not applied; False is what the engine does.
    if initialize == "deepspeed":
        from _helpers import ds_initialize as initialize
    else:
        initialize = zinf.torch.initialize
    for amsgrad in (True, False):
        model = make_model()
        groups = grouped(model)
        groups[1]["amsgrad"] = amsgrad
        config = zinf_config(1, "none", "none", tmp_path)
        if amsgrad:
            with pytest.raises(NotImplementedError,
                               match="^parameter group 1: amsgrad True has no zinf equivalent"):
                initialize(model=model, config=config, model_parameters=groups)
        else:
            engine, optimizer, _, _ = initialize(model=model, config=config,
                                                 model_parameters=groups)
            assert optimizer.param_groups[1]["amsgrad"] is False
            engine.destroy()


def test_a_parameter_left_out_of_the_groups_is_named(tmp_path):
    model = make_model()
    groups = grouped(model)
    groups[1]["params"] = groups[1]["params"][1:]
    with pytest.raises(NotImplementedError, match="leaves out 1 of the model's parameters"):
        zinf.torch.initialize(model=model, config=zinf_config(1, "none", "none", tmp_path),
                              model_parameters=groups)
