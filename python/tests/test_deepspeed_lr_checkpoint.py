"""A DeepSpeed script's learning rates and checkpoint directory: a client optimizer with a torch
scheduler whose warm-up starts at lr 0 (transformers' get_linear_schedule_with_warmup, as
DeepSpeed-Chat and Accelerate's examples pass them to deepspeed.initialize), a base lr of 0 that
a later step raises, save_checkpoint(save_latest=False) and load_checkpoint of a tag that is not
there. Each run is checked against plain torch on the same model and data (the learning rate
of every step, the losses, the parameters) or against the files on disk, as DeepSpeed leaves
them (deepspeed/runtime/engine.py: save_checkpoint writes `latest` only with save_latest, and
load_checkpoint returns (None, None) without a `latest` file)."""
import copy
import os
import re
import warnings

import pytest
import torch

import zinf
import zinf.deepspeed_compat as compat
import zinf.torch
from conftest import CLIP, make_mlp, mlp_batches, mlp_config, mlp_loss

STEPS = 6
WARM_UP = 2
LR = 1e-2


def warm_up_then_decay(step: int) -> float:
    """transformers' get_linear_schedule_with_warmup(WARM_UP, 10): 0 at the first step."""
    if step < WARM_UP:
        return step / WARM_UP
    return max(0.0, (10 - step) / (10 - WARM_UP))


def client_groups(model: torch.nn.Module, case: str) -> list[dict]:
    params = list(model.parameters())
    if case == "one group":
        return [{"params": params}]
    second = {"params": params[1::2], "weight_decay": 0.0}
    if case == "a group at lr 0":
        second["lr"] = 0.0
    return [{"params": params[::2], "weight_decay": 0.1}, second]


def run_torch(model, groups_case, batches, lr_at=None):
    """Plain torch: AdamW over the groups, LambdaLR(warm_up_then_decay) unless lr_at(step)
    sets the lrs, clip_grad_norm_, the scheduler's step after the optimizer's. Returns the
    groups' lrs at each step and after the last, the losses and the model."""
    optimizer = torch.optim.AdamW(client_groups(model, groups_case), lr=0.0 if lr_at else LR)
    scheduler = (None if lr_at else
                 torch.optim.lr_scheduler.LambdaLR(optimizer, warm_up_then_decay))
    lrs, losses = [], []
    for step, batch in enumerate(batches):
        if lr_at:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
        lrs.append([group["lr"] for group in optimizer.param_groups])
        loss = mlp_loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return lrs, [group["lr"] for group in optimizer.param_groups], losses, model


def assert_parameters_match(engine, reference):
    for name, expected in reference.named_parameters():
        got = engine.read_parameter(name)
        # Relative L2; a parameter still at 0 (a LayerNorm bias in a group at lr 0), absolute.
        scale = expected.detach().norm().item() or 1.0
        error = (got - expected.detach()).norm().item() / scale
        assert error < 1e-5, f"{name}: relative error {error:.2e}"


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("groups_case", ["one group", "two groups", "a group at lr 0"])
def test_a_client_scheduler_warming_up_from_zero_trains_as_torch(stage, groups_case):
    # deepspeed.initialize(optimizer=torch AdamW, lr_scheduler=its LambdaLR): DeepSpeed runs the
    # client optimizer's groups as the scheduler sets them, the first step at lr 0.
    batches = mlp_batches(STEPS)
    want_lrs, want_last, want_losses, reference = run_torch(make_mlp(), groups_case, batches)
    model = make_mlp()
    optimizer = torch.optim.AdamW(client_groups(model, groups_case), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warm_up_then_decay)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": CLIP,
              "zero_optimization": {"stage": stage}, "zinf": {"cpu_threads": 1}}
    if stage == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, _, _, returned = compat.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config,
            dist_init_required=False)
        assert returned is scheduler
        lrs, losses = [], []
        for batch in batches:
            lrs.append([group["lr"] for group in optimizer.param_groups])
            loss = mlp_loss(engine, batch)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    assert lrs == want_lrs and lrs[0] == [0.0] * len(lrs[0])
    assert engine.get_lr() == want_last
    assert scheduler.last_epoch == STEPS
    assert losses == pytest.approx(want_losses, rel=1e-5)
    assert_parameters_match(engine, reference)
    # The engine stepped the client's optimizer as DeepSpeed's does, so torch's scheduler does not
    # report a scheduler step before the optimizer's.
    said = [str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)]
    assert not said, said


@pytest.mark.parametrize("how", ["set by hand", "scheduler made by initialize"])
def test_a_base_lr_of_zero_then_a_non_zero_lr_trains_as_torch(how):
    # zinf.torch.initialize: the config's lr is 0 and a later step's is not (a schedule the
    # script computes, or a scheduler of its own over a warm-up).
    batches = mlp_batches(STEPS)
    config = mlp_config(2)
    if how == "set by hand":
        def lr_at(step):
            return [0.0, 0.0, LR / 2, LR, LR, LR / 4][step]
        config["optimizer"]["params"].update(lr=0.0, weight_decay=0.01)
        want_lrs, _, want_losses, reference = run_torch(make_mlp(), "one group", batches, lr_at)
        engine, optimizer, _, _ = zinf.torch.initialize(model=make_mlp(), config=config)
    else:
        lr_at = None
        config["optimizer"]["params"].update(lr=LR, weight_decay=0.01)
        want_lrs, _, want_losses, reference = run_torch(make_mlp(), "one group", batches)
        engine, optimizer, _, _ = zinf.torch.initialize(
            model=make_mlp(), config=config,
            lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, warm_up_then_decay))
    lrs, losses = [], []
    for step, batch in enumerate(batches):
        if lr_at:
            optimizer.param_groups[0]["lr"] = lr_at(step)
        lrs.append([group["lr"] for group in optimizer.param_groups])
        loss = mlp_loss(engine, batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert lrs == want_lrs
    assert losses == pytest.approx(want_losses, rel=1e-5)
    assert_parameters_match(engine, reference)


def test_a_group_of_frozen_parameters_may_move_its_lr_alone():
    # A parameter group holding only frozen parameters trains nothing: a scheduler (or the
    # script) moving its lr by another factor than the trainable group's must not be refused.
    batches = mlp_batches(STEPS)
    config = mlp_config(2)
    config["optimizer"]["params"].update(lr=LR, weight_decay=0.01)

    def frozen_last(model):
        for param in model[4].parameters():
            param.requires_grad_(False)
        trainable = [p for p in model.parameters() if p.requires_grad]
        return model, [{"params": trainable}, {"params": list(model[4].parameters())}]

    model, groups = frozen_last(make_mlp())
    torch_optimizer = torch.optim.AdamW(groups, lr=LR, weight_decay=0.01)
    want_losses = []
    for step, batch in enumerate(batches):
        torch_optimizer.param_groups[1]["lr"] = LR / (step + 2)
        loss = mlp_loss(model, batch)
        torch_optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        torch_optimizer.step()
        want_losses.append(loss.item())
    zinf_model, zinf_groups = frozen_last(make_mlp())
    engine, _, _, _ = zinf.torch.initialize(model=zinf_model, model_parameters=zinf_groups,
                                            config=config)
    losses = []
    for step, batch in enumerate(batches):
        engine.optimizer.param_groups[1]["lr"] = LR / (step + 2)
        loss = mlp_loss(engine, batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses == pytest.approx(want_losses, rel=1e-5)
    assert_parameters_match(engine, model)


def trained_engine(steps=2):
    engine, _, _, _ = zinf.torch.initialize(model=make_mlp(), config=mlp_config(1))
    for batch in mlp_batches(steps):
        engine.backward(mlp_loss(engine, batch))
        engine.step()
    return engine


def test_save_latest_false_leaves_latest_as_it_was(tmp_path):
    engine = trained_engine()
    directory = str(tmp_path / "ckpt")
    # Into an empty directory: no `latest` is written, and a load by `latest` finds none.
    assert engine.save_checkpoint(directory, tag="best", save_latest=False) is True
    assert "best" in os.listdir(directory) and "latest" not in os.listdir(directory)
    with pytest.warns(UserWarning, match="no file 'latest'"):
        assert engine.load_checkpoint(directory) == (None, None)
    engine.save_checkpoint(directory, tag="a")
    with open(os.path.join(directory, "latest"), "rb") as f:
        written = f.read()
    engine.backward(mlp_loss(engine, mlp_batches(1, seed=5)[0]))
    engine.step()
    engine.save_checkpoint(directory, tag="b", save_latest=False)
    with open(os.path.join(directory, "latest"), "rb") as f:
        assert f.read() == written
    assert written.decode().strip() == "a"
    # Both tags load; the default is `latest`'s, a.
    path, _ = engine.load_checkpoint(directory)
    assert path == os.path.join(directory, "a") and engine.global_steps == 2
    path, _ = engine.load_checkpoint(directory, tag="b")
    assert path == os.path.join(directory, "b") and engine.global_steps == 3
    # A later save with save_latest=True names its own tag and keeps the one `latest` skipped.
    engine.save_checkpoint(directory, tag="c")
    with open(os.path.join(directory, "latest")) as f:
        assert f.read().strip() == "c"
    assert engine.load_checkpoint(directory, tag="b")[0] == os.path.join(directory, "b")
    assert not [name for name in os.listdir(directory) if ".tmp" in name]


def test_a_compat_save_again_with_save_latest_is_not_skipped(tmp_path):
    # deepspeed_compat skips a second save of the same tag at the same step (the Trainer's
    # double call at stage 3), but not one that asks for `latest` where the first did not.
    engine, _, _, _ = compat.initialize(model=make_mlp(), config=mlp_config(1),
                                        dist_init_required=False)
    engine.backward(mlp_loss(engine, mlp_batches(1)[0]))
    engine.step()
    directory = str(tmp_path / "ckpt")
    engine.save_checkpoint(directory, tag="best", save_latest=False)
    assert not os.path.exists(os.path.join(directory, "latest"))
    engine.save_checkpoint(directory, tag="best")
    with open(os.path.join(directory, "latest")) as f:
        assert f.read().strip() == "best"


def test_an_unreadable_latest_is_left_naming_the_tag_with_a_warning(tmp_path):
    # `latest` read on rank 0 alone before the collective save: an error there must not raise
    # (the other ranks would wait in the save); the save goes on and says what it left.
    engine = trained_engine()
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "latest").write_bytes(b"\xff\xfe not text")
    with pytest.warns(UserWarning, match="could not be read before the save"):
        engine.save_checkpoint(str(directory), tag="best", save_latest=False)
    assert (directory / "latest").read_text().strip() == "best"


def test_save_latest_false_is_refused_where_pruning_could_remove_latests_tag(tmp_path):
    config = mlp_config(1)
    config["zinf"]["keep_last"] = 2
    engine, _, _, _ = zinf.torch.initialize(model=make_mlp(), config=config)
    with pytest.raises(NotImplementedError, match="save_latest=False.*keep_last 2"):
        engine.save_checkpoint(str(tmp_path), tag="x", save_latest=False)
    assert not os.path.exists(tmp_path / "x")


def test_a_load_of_a_missing_tag_raises_naming_it(tmp_path):
    # DeepSpeed's load_checkpoint raises for a tag that has no files (an AssertionError from
    # its state-dict loader's empty file list); zinf's names the path. Without a tag and
    # without `latest` both return (None, None) with a warning (test_engine.py).
    engine = trained_engine(1)
    engine.save_checkpoint(str(tmp_path), tag="a")
    with pytest.raises(zinf.Error, match=f"not_found: .*'{re.escape(str(tmp_path))}/missing'"):
        engine.load_checkpoint(str(tmp_path), tag="missing")
