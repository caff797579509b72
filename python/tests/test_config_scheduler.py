"""The config's `scheduler` section: the engine runs DeepSpeed's schedule, and torch's
param_groups "lr"s (and engine.get_lr()) show the rate of the next step after every step, as
DeepSpeed's do. Checked against the schedules' formulas written out in double precision (those of
deepspeed/runtime/lr_schedules.py), and the training against torch.optim.AdamW stepped at the
same rates."""
import math

import pytest
import torch

import zinf.torch
from conftest import (BETAS, EPS, LR, make_batches, make_mlp, make_model, mlp_batches, mlp_loss,
                      train_mlp_zinf, train_torch, train_zinf, zinf_config)

STEPS = 12
WARMUP, TOTAL = 5, 10


def warmup_gamma(n, linear):
    """DeepSpeed's warm-up fraction at last_batch_iteration n (0 <= n), W = max(2, warmup)."""
    w = max(2, WARMUP)
    if n >= w:
        return 1.0
    return n / w if linear else math.log(n + 1) / math.log(w)


def warmup_decay_lr(n, min_lr=1e-4, max_lr=LR):
    """WarmupDecayLR, linear warm-up from min_lr to max_lr, then linear decay to 0 at TOTAL."""
    if n < 0:
        return min_lr
    w = max(2, WARMUP)
    if n < w:
        return min_lr + (max_lr - min_lr) * warmup_gamma(n, linear=True)
    return min_lr + (max_lr - min_lr) * max(0.0, (TOTAL - n) / max(1.0, TOTAL - w))


def warmup_cosine_lr(n, min_ratio=0.1, cos_min_ratio=0.01):
    """WarmupCosineLR, log warm-up of the ratio from min_ratio to 1, then a cosine to
    cos_min_ratio at TOTAL; the optimizer's lr times the ratio."""
    if n < 0:
        return 0.0
    w = max(2, WARMUP)
    if n < w:
        ratio = min_ratio + (1.0 - min_ratio) * warmup_gamma(n, linear=False)
    else:
        progress = min(1.0, (n - w + 1) / max(1, TOTAL - w))
        ratio = max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)
    return LR * ratio


SCHEDULES = {
    "WarmupDecayLR": ({"warmup_min_lr": 1e-4, "warmup_max_lr": LR, "warmup_num_steps": WARMUP,
                       "total_num_steps": TOTAL, "warmup_type": "linear"}, warmup_decay_lr),
    "WarmupCosineLR": ({"warmup_min_ratio": 0.1, "cos_min_ratio": 0.01,
                        "warmup_num_steps": WARMUP, "total_num_steps": TOTAL}, warmup_cosine_lr),
}


def scheduled_config(kind, tmp_path, stage=1, offload="none"):
    config = zinf_config(stage, offload, offload if stage == 3 else "none", tmp_path,
                         **({"stage3_param_persistence_threshold": 0} if stage == 3 else {}))
    config["scheduler"] = {"type": kind, "params": SCHEDULES[kind][0]}
    return config


def grouped(model):
    """A second group at twice the config's lr: the engine runs it at twice the schedule's."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": matrices}, {"params": vectors, "lr": 2 * LR}]


def torch_run(batches, lr_at):
    """torch.optim.AdamW with the groups above, step k (k = 1, 2, ...) at lr_at(k - 2) as
    DeepSpeed's engine runs it (the scheduler built at iteration -1, stepped after each step)."""
    model = make_model()
    optimizer = torch.optim.AdamW(grouped(model), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.01)

    def set_lrs(k, optimizer):
        for group, scale in zip(optimizer.param_groups, (1.0, 2.0)):
            group["lr"] = lr_at(k - 2) * scale

    losses = train_torch(model, optimizer, batches, set_lrs=set_lrs)
    return losses, dict(model.named_parameters())


@pytest.mark.parametrize("kind", sorted(SCHEDULES))
def test_param_groups_show_the_schedule_of_each_step(kind, tmp_path):
    lr_at = SCHEDULES[kind][1]
    model = make_model()
    engine, optimizer, _, _ = zinf.torch.initialize(
        model=model, config=scheduled_config(kind, tmp_path), model_parameters=grouped(model))
    # Before the first step: the rate the first step runs with, iteration -1's.
    assert engine.get_lr() == pytest.approx([lr_at(-1), 2 * lr_at(-1)], rel=1e-12, abs=1e-18)
    shown = []
    for k, batch in enumerate(make_batches(STEPS), start=1):
        train_zinf(engine, [batch])
        expected = lr_at(k - 1)  # the next step's (k + 1) rate
        assert engine.get_lr() == pytest.approx([expected, 2 * expected], rel=1e-12, abs=1e-18)
        assert [g["lr"] for g in optimizer.param_groups] == engine.get_lr()
        shown.append(engine.get_lr()[0])
    # The schedule moved, up through the warm-up and down after it.
    peak = shown.index(max(shown))
    assert 0 < peak < STEPS - 1 and shown[-1] < shown[peak] and len(set(shown)) >= 5


@pytest.mark.parametrize("kind,stage,offload", [("WarmupCosineLR", 1, "none"),
                                                ("WarmupDecayLR", 3, "cpu")])
def test_training_follows_the_schedule(kind, stage, offload, tmp_path):
    """The rates shown are the rates run: the parameters end where torch's AdamW ends when it
    is stepped at the schedule's rates."""
    batches = make_batches(STEPS)
    expected_losses, expected = torch_run(batches, SCHEDULES[kind][1])
    model = make_model()
    engine, _, _, _ = zinf.torch.initialize(
        model=model, config=scheduled_config(kind, tmp_path, stage, offload),
        model_parameters=grouped(model))
    assert train_zinf(engine, batches) == pytest.approx(expected_losses, rel=1e-5)
    worst = 0.0
    for name, reference in expected.items():
        got = engine.read_parameter(name)
        if name.endswith("attn.c_attn.bias"):
            # The key bias's gradient is rounding noise (test_oracle.key_bias).
            got, reference = got[:64], reference[:64]
        worst = max(worst, ((got - reference).norm() / reference.norm()).item())
    print(f"{kind} stage {stage} {offload}: worst parameter's relative error {worst:.2e}")
    assert worst < 1e-5


def test_a_changed_lr_replaces_the_schedule(tmp_path):
    """Setting a group's lr by hand (as with DeepSpeed) overrides the schedule from then on."""
    model = make_model()
    engine, optimizer, _, _ = zinf.torch.initialize(
        model=model, config=scheduled_config("WarmupCosineLR", tmp_path),
        model_parameters=model.parameters())
    batches = make_batches(4)
    train_zinf(engine, batches[:2])
    optimizer.param_groups[0]["lr"] = 0.0
    before = engine.read_parameter("transformer.ln_f.bias")
    train_zinf(engine, batches[2:3])
    # lr 0: AdamW moves nothing (its weight decay is lr * wd * p).
    assert torch.equal(engine.read_parameter("transformer.ln_f.bias"), before)
    assert engine.get_lr() == [0.0]


def test_a_checkpoint_resumes_the_schedule(tmp_path):
    kind = "WarmupDecayLR"
    lr_at = SCHEDULES[kind][1]
    batches = make_batches(6)
    engine, _, _, _ = zinf.torch.initialize(model=make_model(),
                                            config=scheduled_config(kind, tmp_path))
    train_zinf(engine, batches[:3])
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    expected = train_zinf(engine, batches[3:])
    resumed, _, _, _ = zinf.torch.initialize(model=make_model(),
                                             config=scheduled_config(kind, tmp_path))
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.get_lr() == pytest.approx([lr_at(2)], rel=1e-12)
    assert train_zinf(resumed, batches[3:]) == expected
    assert resumed.get_lr() == pytest.approx([lr_at(5)], rel=1e-12)


def test_a_config_scheduler_and_an_lr_scheduler_are_refused(tmp_path):
    model = make_model()
    with pytest.raises(ValueError, match="scheduler"):
        zinf.torch.initialize(
            model=model, config=scheduled_config("WarmupCosineLR", tmp_path),
            model_parameters=model.parameters(),
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))


def test_initialize_returns_the_schedule(tmp_path):
    """initialize() returns an lr_scheduler for the config's section (DeepSpeed returns its
    scheduler object): it reports the rate of the next step and DeepSpeed's iteration count,
    a call to its step() leaves the engine's schedule alone (engine.step() advances it), and a
    checkpoint restores its state."""
    kind = "WarmupDecayLR"
    lr_at = SCHEDULES[kind][1]
    batches = mlp_batches(5)
    engine, _, _, scheduler = zinf.torch.initialize(
        model=make_mlp(), config=scheduled_config(kind, tmp_path))
    assert scheduler is not None and engine.lr_scheduler is scheduler
    assert scheduler.get_last_lr() == pytest.approx([lr_at(-1)], rel=1e-12)
    assert scheduler.last_batch_iteration == -1
    for k, batch in enumerate(batches[:3], start=1):
        train_mlp_zinf(engine, [batch])
        assert scheduler.get_last_lr() == pytest.approx([lr_at(k - 1)], rel=1e-12)
        assert scheduler.get_lr() == scheduler.get_last_lr() == engine.get_lr()
        assert scheduler.state_dict() == {"last_batch_iteration": k - 1}
    with pytest.warns(UserWarning, match="advanced by engine.step"):
        scheduler.step()
    assert scheduler.last_batch_iteration == 2
    assert scheduler.get_last_lr() == pytest.approx([lr_at(2)], rel=1e-12)
    with pytest.raises(ValueError, match="last_batch_iteration 7.*engine.load_checkpoint"):
        scheduler.load_state_dict({"last_batch_iteration": 7})
    engine.save_checkpoint(str(tmp_path / "ckpt"))

    resumed, _, _, resumed_scheduler = zinf.torch.initialize(
        model=make_mlp(), config=scheduled_config(kind, tmp_path))
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed_scheduler.state_dict() == {"last_batch_iteration": 2}
    train_mlp_zinf(resumed, batches[3:])
    assert resumed_scheduler.last_batch_iteration == 4
    assert resumed_scheduler.get_last_lr() == pytest.approx([lr_at(4)], rel=1e-12)


def test_a_step_skipped_for_an_overflow_leaves_the_schedule_where_it_was(tmp_path):
    """DeepSpeed steps its scheduler only after a step it applied: an fp16 step skipped for an
    overflow moves neither the rate nor last_batch_iteration, before or after a resume."""
    kind = "WarmupDecayLR"
    lr_at = SCHEDULES[kind][1]
    config = scheduled_config(kind, tmp_path)
    config["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    batches = [(x.half(), y.half()) for x, y in mlp_batches(6)]

    def train(engine, batches, overflow_at=None):
        for index, batch in enumerate(batches):
            loss = mlp_loss(engine, batch).float()
            engine.backward(loss * float("inf") if index == overflow_at else loss)
            engine.step()

    engine, _, _, scheduler = zinf.torch.initialize(model=make_mlp(), config=config)
    train(engine, batches[:3], overflow_at=1)
    assert (engine.global_steps, engine.skipped_steps) == (3, 1)
    assert scheduler.last_batch_iteration == 1
    assert engine.get_lr() == pytest.approx([lr_at(1)], rel=1e-12)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    train(engine, batches[3:])
    expected = [p.detach().clone() for p in engine.module.parameters()]
    assert scheduler.last_batch_iteration == 4
    assert engine.get_lr() == pytest.approx([lr_at(4)], rel=1e-12)

    resumed, _, _, resumed_scheduler = zinf.torch.initialize(model=make_mlp(), config=config)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed_scheduler.last_batch_iteration == 1
    assert resumed.get_lr() == pytest.approx([lr_at(1)], rel=1e-12)
    train(resumed, batches[3:])
    assert resumed_scheduler.last_batch_iteration == 4
    assert resumed.get_lr() == pytest.approx([lr_at(4)], rel=1e-12)
    for got, want in zip(resumed.module.parameters(), expected):
        assert torch.equal(got, want)


def test_a_resumed_run_follows_its_own_configs_schedule(tmp_path):
    """DeepSpeed's checkpoint keeps only the scheduler's last_batch_iteration: a run resumed with
    a longer total_num_steps (or a new warmup_max_lr) follows the new curve from there."""
    def config(total, max_lr=LR):
        config = scheduled_config("WarmupDecayLR", tmp_path)
        config["scheduler"]["params"].update(total_num_steps=total, warmup_max_lr=max_lr)
        return config

    def warmup_decay(n, total, max_lr=LR, min_lr=1e-4):
        w = max(2, WARMUP)
        if n < w:
            return min_lr + (max_lr - min_lr) * n / w
        return min_lr + (max_lr - min_lr) * max(0.0, (total - n) / max(1.0, total - w))

    batches = mlp_batches(8)
    engine, _, _, _ = zinf.torch.initialize(model=make_mlp(), config=config(TOTAL))
    train_mlp_zinf(engine, batches[:6])
    assert engine.get_lr() == pytest.approx([warmup_decay(5, TOTAL)], rel=1e-12)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    for total, max_lr in ((2 * TOTAL, LR), (TOTAL, LR / 2)):
        resumed, _, _, scheduler = zinf.torch.initialize(model=make_mlp(),
                                                         config=config(total, max_lr))
        resumed.load_checkpoint(str(tmp_path / "ckpt"))
        assert scheduler.last_batch_iteration == 5
        assert resumed.get_lr() == pytest.approx([warmup_decay(5, total, max_lr)], rel=1e-12)
        train_mlp_zinf(resumed, batches[6:])
        assert resumed.get_lr() == pytest.approx([warmup_decay(7, total, max_lr)], rel=1e-12)


def test_one_cycle_shows_its_momentum_in_the_groups_betas(tmp_path):
    """DeepSpeed's OneCycle cycles beta1 (and sets beta2 to 0.99) in the optimizer's groups;
    get_mom() and param_groups' "betas" show the next step's, from its formula in double:
    scale = x / (S1 / S) in the first half of the cycle, x = b / S - floor(b / S), b = n + 1,
    beta1 = cycle_max_mom - (cycle_max_mom - cycle_min_mom) * scale; before the first step
    (iteration -1) DeepSpeed's OneCycle sets cycle_min_mom."""
    first, second, min_mom, max_mom = 3, 3, 0.8, 0.9
    config = scheduled_config("WarmupDecayLR", tmp_path)
    config["scheduler"] = {"type": "OneCycle", "params": {
        "cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": first,
        "cycle_min_mom": min_mom, "cycle_max_mom": max_mom}}

    def beta1(n):
        if n < 0:
            return min_mom
        size = first + second
        x = (n + 1) / size - math.floor((n + 1) / size)
        ratio = first / size
        scale = x / ratio if x <= ratio else (x - 1) / (ratio - 1)
        return max_mom - (max_mom - min_mom) * scale

    engine, optimizer, _, _ = zinf.torch.initialize(model=make_mlp(), config=config)
    for k, batch in enumerate(mlp_batches(5)):
        # After k applied steps the next runs at iteration k - 1.
        assert engine.get_mom()[0] == pytest.approx((beta1(k - 1), 0.99), rel=1e-12), k
        assert optimizer.param_groups[0]["betas"] == engine.get_mom()[0]
        train_mlp_zinf(engine, [batch])
