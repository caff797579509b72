"""deepspeed.initialize(optimizer=...) with a torch optimizer object or DeepSpeedCPUAdam: the
engine trains as the object would. torch's Adam adds weight_decay to the gradient (L2), as
DeepSpeedCPUAdam(adamw_mode=False) does; AdamW, Adam(decoupled_weight_decay=True) and
DeepSpeedCPUAdam(adamw_mode=True) decay the weights (deepspeed/ops/adam/cpu_adam.py; DeepSpeed
steps a client torch optimizer itself). torch's Adagrad takes eps, lr_decay and
initial_accumulator_value; the engine's state sum starts at 0, so the last is refused unless it
is 0. DeepSpeedCPUAdagrad has DeepSpeed's signature (eps third, no lr_decay) and update, which
reads lr, eps and weight_decay only. Each run is checked against plain torch, or DeepSpeed's
update written out, on the same model and data."""
import pytest
import torch

import zinf.deepspeed_compat as compat
from conftest import make_mlp, mlp_batches, mlp_loss

STEPS = 5
LR = 1e-2


def split_groups(model: torch.nn.Module, decay: float) -> list[dict]:
    """Two groups, the first with its own weight_decay and the second at the optimizer's."""
    params = list(model.parameters())
    return [{"params": params[::2], "weight_decay": decay}, {"params": params[1::2]}]


def train_torch(model, optimizer, batches):
    for batch in batches:
        optimizer.zero_grad()
        mlp_loss(model, batch).backward()
        optimizer.step()
    return model


def train_engine(model, optimizer, batches, stage, offload="none"):
    config = {"train_micro_batch_size_per_gpu": 4, "zinf": {"cpu_threads": 1},
              "zero_optimization": {"stage": stage, "offload_optimizer": {"device": offload}}}
    if stage == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, _, _, _ = compat.initialize(model=model, optimizer=optimizer, config=config,
                                        dist_init_required=False)
    for batch in batches:
        engine.backward(mlp_loss(engine, batch))
        engine.step()
    return engine


def assert_trained_as(engine, reference):
    for name, expected in reference.named_parameters():
        torch.testing.assert_close(engine.read_parameter(name), expected.detach(), rtol=0,
                                   atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


ADAM_CASES = {
    # (the optimizer given to initialize, the torch optimizer it must train as)
    "Adam, weight_decay 0.1":
        (lambda m: torch.optim.Adam(m.parameters(), lr=LR, weight_decay=0.1),
         lambda m: torch.optim.Adam(m.parameters(), lr=LR, weight_decay=0.1)),
    "Adam, one group's weight_decay 0.1":
        (lambda m: torch.optim.Adam(split_groups(m, 0.1), lr=LR),
         lambda m: torch.optim.Adam(split_groups(m, 0.1), lr=LR)),
    "Adam, decoupled_weight_decay":
        (lambda m: torch.optim.Adam(m.parameters(), lr=LR, weight_decay=0.1,
                                    decoupled_weight_decay=True),
         lambda m: torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.1)),
}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("case", list(ADAM_CASES))
def test_a_torch_adam_object_trains_as_torch(stage, case):
    if case == "Adam, decoupled_weight_decay" and "decoupled_weight_decay" not in \
            torch.optim.Adam(make_mlp().parameters()).defaults:
        pytest.skip("this torch's Adam has no decoupled_weight_decay")
    given, reference = ADAM_CASES[case]
    batches = mlp_batches(STEPS)
    want_model = make_mlp()
    train_torch(want_model, reference(want_model), batches)
    model = make_mlp()
    engine = train_engine(model, given(model), batches, stage)
    assert_trained_as(engine, want_model)


def test_an_adamw_that_is_no_adam_subclass_is_mapped(monkeypatch):
    # torch before 2.7 (pyproject allows >= 2.1) defines AdamW beside Adam, not under it.
    class OldAdamW(torch.optim.Optimizer):
        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
            super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                          amsgrad=False, maximize=False))

    batches = mlp_batches(STEPS)
    want_model = make_mlp()
    train_torch(want_model, torch.optim.AdamW(want_model.parameters(), lr=LR, weight_decay=0.1),
                batches)
    monkeypatch.setattr(torch.optim, "AdamW", OldAdamW)
    assert not issubclass(torch.optim.AdamW, torch.optim.Adam)
    model = make_mlp()
    engine = train_engine(model, OldAdamW(model.parameters(), lr=LR, weight_decay=0.1), batches, 2)
    assert_trained_as(engine, want_model)


@pytest.mark.parametrize("adamw_mode", [False, True])
def test_deepspeed_cpu_adam_trains_as_torch(adamw_mode):
    # Accelerate turns the Trainer's torch Adam into DeepSpeedCPUAdam(adamw_mode=False) and its
    # AdamW into adamw_mode=True under optimizer offload (map_pytorch_optim_to_deepspeed).
    batches = mlp_batches(STEPS)
    want_model = make_mlp()
    torch_class = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    train_torch(want_model, torch_class(want_model.parameters(), lr=LR, weight_decay=0.1),
                batches)
    model = make_mlp()
    optimizer = compat.DeepSpeedCPUAdam(model.parameters(), lr=LR, weight_decay=0.1,
                                        adamw_mode=adamw_mode)
    engine = train_engine(model, optimizer, batches, 2, offload="cpu")
    assert_trained_as(engine, want_model)


@pytest.mark.parametrize("adam_w_mode", [False, True])
def test_fused_adam_takes_its_own_adam_w_mode_argument(adam_w_mode):
    # deepspeed.ops.adam.FusedAdam names the switch adam_w_mode (DeepSpeedCPUAdam: adamw_mode).
    batches = mlp_batches(STEPS)
    want_model = make_mlp()
    torch_class = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    train_torch(want_model, torch_class(want_model.parameters(), lr=LR, weight_decay=0.1),
                batches)
    model = make_mlp()
    fused_adam = compat._MODULES["deepspeed.ops.adam"]["FusedAdam"]  # deepspeed.ops.adam's
    optimizer = fused_adam(model.parameters(), lr=LR, weight_decay=0.1, adam_w_mode=adam_w_mode)
    engine = train_engine(model, optimizer, batches, 2)
    assert_trained_as(engine, want_model)


@pytest.mark.parametrize("options", [{"eps": 1e-2}, {"lr_decay": 0.5}])
def test_a_torch_adagrad_object_trains_as_torch(options):
    batches = mlp_batches(STEPS)
    want_model = make_mlp()
    train_torch(want_model, torch.optim.Adagrad(want_model.parameters(), lr=LR,
                                                weight_decay=0.1, **options), batches)
    model = make_mlp()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=LR, weight_decay=0.1, **options)
    engine = train_engine(model, optimizer, batches, 2)
    assert_trained_as(engine, want_model)


def test_an_adagrad_setting_the_engine_lacks_is_refused_naming_it():
    model = make_mlp()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=LR, initial_accumulator_value=0.5)
    with pytest.raises(NotImplementedError, match="initial_accumulator_value=0.5"):
        train_engine(model, optimizer, [], 2)
    model = make_mlp()
    params = list(model.parameters())
    optimizer = torch.optim.Adagrad([{"params": params[:2], "lr_decay": 0.5},
                                     {"params": params[2:]}], lr=LR)
    with pytest.raises(NotImplementedError, match="different lr_decay values"):
        train_engine(model, optimizer, [], 2)


def test_amsgrad_is_refused_naming_the_optimizer_or_the_group():
    # torch's Adam with amsgrad=True for every group, or in one group only: named where set.
    model = make_mlp()
    with pytest.raises(NotImplementedError, match="the optimizer's amsgrad=True"):
        train_engine(model, torch.optim.Adam(model.parameters(), lr=LR, amsgrad=True), [], 2)
    model = make_mlp()
    params = list(model.parameters())
    optimizer = torch.optim.Adam([{"params": params[:2]}, {"params": params[2:], "amsgrad": True}],
                                 lr=LR)
    with pytest.raises(NotImplementedError, match="parameter group 1's amsgrad=True"):
        train_engine(model, optimizer, [], 2)


def test_an_optimizer_type_the_engine_lacks_is_refused_by_its_name_before_its_options():
    # SGD with Nesterov momentum: the refusal names SGD, not nesterov=True (which would suggest
    # that plain SGD were mapped).
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    with pytest.raises(NotImplementedError) as refusal:
        train_engine(model, optimizer, [], 2)
    assert "the optimizer SGD has no zinf equivalent" in str(refusal.value)
    assert "nesterov" not in str(refusal.value)


def train_deepspeed_adagrad(model, batches, lr, eps):
    """DeepSpeed's CPU Adagrad update (csrc/adagrad/cpu_adagrad.cpp) at weight_decay 0, written
    out: the sum of squares starts at 0, v += g*g, p -= lr * g / (sqrt(v) + eps); no lr decay."""
    params = list(model.parameters())
    sums = [torch.zeros_like(p) for p in params]
    for batch in batches:
        model.zero_grad()
        mlp_loss(model, batch).backward()
        with torch.no_grad():
            for p, v in zip(params, sums):
                v += p.grad * p.grad
                p -= lr * p.grad / (v.sqrt() + eps)
    return model


def deepspeed_cpu_adagrad():
    return compat._MODULES["deepspeed.ops.adagrad"]["DeepSpeedCPUAdagrad"]


DEEPSPEED_ADAGRAD_CASES = {
    # DeepSpeed's signature is (model_params, lr, eps, weight_decay, amsgrad,
    # fp32_optimizer_states): the third positional argument is eps (torch's is lr_decay).
    "eps third": lambda params: deepspeed_cpu_adagrad()(params, LR, 1e-2),
    # DeepSpeed's update never reads amsgrad.
    "amsgrad, fp32_optimizer_states": lambda params: deepspeed_cpu_adagrad()(
        params, lr=LR, eps=1e-2, amsgrad=True, fp32_optimizer_states=True),
    # Accelerate's map_pytorch_optim_to_deepspeed under optimizer offload: the torch Adagrad's
    # groups (with its eps, and an lr_decay and initial_accumulator_value DeepSpeed does not
    # apply) and its lr and weight_decay.
    "a torch Adagrad's groups": lambda params: deepspeed_cpu_adagrad()(
        torch.optim.Adagrad(params, lr=LR, eps=1e-2, lr_decay=0.5,
                            initial_accumulator_value=0.5).param_groups, lr=LR, weight_decay=0),
}


@pytest.mark.parametrize("case", DEEPSPEED_ADAGRAD_CASES)
def test_deepspeed_cpu_adagrad_trains_as_deepspeeds_update(case):
    batches = mlp_batches(STEPS)
    want_model = train_deepspeed_adagrad(make_mlp(), batches, LR, 1e-2)
    model = make_mlp()
    engine = train_engine(model, DEEPSPEED_ADAGRAD_CASES[case](model.parameters()), batches, 2,
                          offload="cpu")
    assert_trained_as(engine, want_model)


def test_deepspeed_cpu_adagrad_is_read_as_deepspeed_reads_it(caplog):
    model = make_mlp()
    section, groups = compat._optimizer_section(
        deepspeed_cpu_adagrad()(model.parameters(), 0.01, 1e-6))
    assert section == {"type": "Adagrad",
                       "params": {"lr": 0.01, "weight_decay": 0.0, "eps": 1e-6}}
    # As Accelerate makes it: the torch Adagrad's groups (no decay in the first, the optimizer's
    # 0.1 in the second, as the Trainer's groups) and its lr and weight_decay.
    torch_adagrad = torch.optim.Adagrad(split_groups(model, 0.0), lr=0.02, eps=1e-3,
                                        weight_decay=0.1, lr_decay=0.5,
                                        initial_accumulator_value=0.5)
    with caplog.at_level("WARNING", logger="DeepSpeed"):
        section, groups = compat._optimizer_section(
            deepspeed_cpu_adagrad()(torch_adagrad.param_groups, lr=0.02, weight_decay=0.1))
    assert section == {"type": "Adagrad",
                       "params": {"lr": 0.02, "weight_decay": 0.1, "eps": 1e-3}}
    assert [(g["lr"], g["weight_decay"], g["eps"]) for g in groups] == [(0.02, 0.0, 1e-3),
                                                                      (0.02, 0.1, 1e-3)]
    assert "initial_accumulator_value=0.5, lr_decay=0.5" in caplog.text
    with pytest.raises(NotImplementedError, match="fp32_optimizer_states=False"):
        deepspeed_cpu_adagrad()(model.parameters(), fp32_optimizer_states=False)


def test_deepspeed_cpu_adam_refuses_fp32_optimizer_states_false():
    # As DeepSpeedCPUAdagrad: the state in the parameters' dtype has no zinf equivalent, and the
    # engine would train with fp32 state while the script asked for another.
    model = make_mlp()
    cpu_adam = compat._MODULES["deepspeed.ops.adam"]["DeepSpeedCPUAdam"]  # deepspeed.ops.adam's
    with pytest.raises(NotImplementedError,
                       match=r"^DeepSpeedCPUAdam \(zinf\.deepspeed_compat\): "
                             r"fp32_optimizer_states=False has no zinf equivalent"):
        cpu_adam(model.parameters(), lr=0.01, fp32_optimizer_states=False)
    # DeepSpeed's default, given by name, is read as if left out.
    section, _ = compat._optimizer_section(
        cpu_adam(model.parameters(), lr=0.01, fp32_optimizer_states=True))
    assert section == compat._optimizer_section(cpu_adam(model.parameters(), lr=0.01))[0]
    assert section["params"]["lr"] == 0.01
