"""zinf.torch's engine in DeepSpeed's call shape: config from a JSON file, the learning rate
(set directly and by a torch scheduler), the loss scale, checkpoints, gradient accumulation, and
bf16 mixed precision."""
import contextlib
import json
import os

import pytest
import torch

import zinf.torch
from conftest import (LR, assert_mlp_matches, make_batches, make_mlp, make_model, mlp_batches,
                      mlp_config, mlp_loss, train_mlp_torch, train_mlp_zinf, train_zinf,
                      zinf_config)


def open_engine(config, **kwargs):
    model = make_model()
    return zinf.torch.initialize(model=model, config=config, model_parameters=model.parameters(),
                                 **kwargs)


def test_config_from_a_json_path_and_the_returned_tuple(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(zinf_config(2)))
    engine, optimizer, loader, scheduler = open_engine(str(path))
    assert isinstance(engine.module, torch.nn.Module) and engine.stage == 2
    assert optimizer.param_groups[0]["lr"] == LR and engine.get_lr() == [LR]
    assert loader is None and scheduler is None
    assert engine.loss_scale == 1.0


def test_a_config_file_with_comments_and_trailing_commas_reads_as_deepspeed_reads_it(tmp_path):
    # DeepSpeed reads config files with hjson: comments and trailing commas are common in them.
    lines = json.dumps(zinf_config(2), indent=2).splitlines()
    text = "# ZeRO-2\n" + "\n".join(lines[:-1]) + ",  // last key\n  /* done */\n}\n"
    path = tmp_path / "ds_config.json"
    path.write_text(text)
    engine, _, _, _ = open_engine(str(path))
    assert engine.stage == 2 and engine.get_lr() == [LR]
    # A key given twice is refused, as DeepSpeed's reader refuses it.
    path.write_text('{"zero_optimization": {"stage": 2, "stage": 3}}')
    with pytest.raises(ValueError, match="zero_optimization.stage: given twice in one object"):
        open_engine(str(path))


def test_a_scheduler_sets_the_learning_rate_of_each_step(tmp_path):
    batches = make_batches(2)
    # A learning rate of 0 for the second step must leave the parameters as they were.
    engine, _, _, scheduler = open_engine(
        zinf_config(3, "cpu", "cpu", tmp_path, stage3_param_persistence_threshold=0),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s))
    train_zinf(engine, batches[:1])
    assert engine.get_lr() == [0.0]
    before = engine.read_parameter("transformer.wte.weight")
    train_zinf(engine, batches[1:])
    assert torch.equal(engine.read_parameter("transformer.wte.weight"), before)
    assert engine.global_steps == 2


def test_checkpoint_resumes_the_same_trajectory(tmp_path):
    batches = make_batches(8)
    config = zinf_config(3, "nvme", "cpu", tmp_path / "swap", stage3_param_persistence_threshold=0)
    engine, _, _, _ = open_engine(config)
    train_zinf(engine, batches[:4])
    engine.save_checkpoint(str(tmp_path / "ckpt"), client_state={"epoch": 3})
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step4"
    expected = train_zinf(engine, batches[4:])

    resumed, _, _, _ = open_engine(config)
    path, client_state = resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert path.endswith("global_step4") and client_state == {"epoch": 3}
    assert resumed.global_steps == 4
    assert train_zinf(resumed, batches[4:]) == expected


def test_exported_safetensors_equal_read_parameter(tmp_path):
    # The checkpoint's masters through zinf.torch.export_safetensors, loaded by the safetensors
    # package, equal the engine's fp32 masters (bf16: rounded to nearest even, as torch rounds).
    load_file = pytest.importorskip("safetensors.torch").load_file
    config = zinf_config(3, "cpu", "none", tmp_path / "swap", stage3_param_persistence_threshold=0)
    engine, _, _, _ = open_engine(config)
    train_zinf(engine, make_batches(3))
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    names = sorted(engine._names.values())
    for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        out = tmp_path / f"model-{dtype}.safetensors"
        zinf.torch.export_safetensors(str(tmp_path / "ckpt"), str(out), dtype=dtype)
        tensors = load_file(str(out))
        assert sorted(tensors) == names
        for name in names:
            want = engine.read_parameter(name).to(torch_dtype)
            assert tensors[name].dtype == torch_dtype
            assert torch.equal(tensors[name], want), name


def test_gradient_accumulation_steps_at_the_boundary_on_the_mean(tmp_path, torch_reference):
    # Two micro-batches of 2 rows stepping once equal one batch of 4 rows (the loss is a mean
    # over tokens, and every row has the same number of tokens).
    config = zinf_config(2)
    config["gradient_accumulation_steps"] = 2
    engine, _, _, _ = open_engine(config)
    losses = []
    for ids, labels in make_batches(3):
        total = 0.0
        for half in (slice(0, 2), slice(2, 4)):
            loss = engine(input_ids=ids[half], labels=labels[half]).loss
            engine.backward(loss)
            engine.step()
            total += loss.item() / 2
        losses.append(total)
    assert engine.global_steps == 3
    assert losses == pytest.approx(torch_reference[0][:3], rel=1e-5)


def test_bf16_converges_with_fp32(tmp_path, torch_reference):
    engine, _, _, _ = open_engine(zinf_config(3, "cpu", "cpu", tmp_path, bf16=True,
                                              stage3_param_persistence_threshold=0))
    losses = train_zinf(engine, make_batches())
    assert next(engine.module.parameters()).dtype == torch.bfloat16
    fp32_final = torch_reference[0][-1]
    print(f"bf16 final loss {losses[-1]:.4f}, fp32 {fp32_final:.4f}")
    assert losses[-1] < 0.8 * losses[0]
    assert losses[-1] == pytest.approx(fp32_final, rel=0.02)


def test_fp16_scales_the_loss_and_trains(tmp_path):
    config = zinf_config(2, "cpu")
    config["fp16"] = {"enabled": True, "initial_scale_power": 12}
    engine, optimizer, _, _ = open_engine(config)
    assert engine.loss_scale == 4096.0 and optimizer.loss_scale == 4096.0
    assert next(engine.module.parameters()).dtype == torch.float16
    losses = train_zinf(engine, make_batches(8))
    report = engine.last_step_report
    assert report["loss_scale"] == 4096.0 and not report["skipped"]
    assert losses[-1] < 0.9 * losses[0]


def offloaded_config(swap, overlap, clipping):
    """bf16 at stage 3, optimizer state on NVMe and parameters in host memory (none persistent)."""
    config = zinf_config(3, "nvme", "cpu", swap, bf16=True, stage3_param_persistence_threshold=0)
    config["gradient_clipping"] = clipping
    config["zinf"]["overlap_step"] = overlap
    return config


def step_reports(engine, batches):
    """One backward and step() a batch; each step's last_step_report."""
    reports = []
    for ids, labels in batches:
        engine.backward(engine(input_ids=ids, labels=labels).loss)
        engine.step()
        reports.append(engine.last_step_report)
    return reports


def test_without_clipping_the_step_updates_during_the_backward_with_the_schedulers_rates(tmp_path):
    # No clipping and bf16 at stage 3 with the optimizer state offloaded: the engine's optimizer
    # pass begins in the backward (StepReport in_backward). The torch
    # scheduler's rate for each step reaches the engine before the backward that begins it, so the
    # parameters are the bits of the sequential step's (zinf.overlap_step false).
    batches = make_batches(4)
    params = {}
    for overlap in (False, True):
        config = offloaded_config(tmp_path / f"swap{overlap}", overlap, clipping=0.0)
        schedule = (lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - 0.2 * s))
        engine, _, _, _ = open_engine(config, lr_scheduler=schedule)
        in_backward = [r["in_backward"] for r in step_reports(engine, batches)]
        params[overlap] = engine.read_parameter("transformer.wte.weight")
        # The first step runs at the configured rate, so its pass opens in the backward (the
        # package declares the micro-batch count); every later step sets a new rate, which the
        # engine's schedule then no longer sets, so no pass opens early. The rates are right
        # either way.
        assert in_backward == ([True, False, False, False] if overlap else [False] * 4)
    assert torch.equal(params[False], params[True])

    # Without a scheduler the pass opens in the backward from the first step on.
    config = offloaded_config(tmp_path / "swap_const", True, clipping=0.0)
    engine, _, _, _ = open_engine(config)
    reports = step_reports(engine, batches)
    assert [r["in_backward"] for r in reports] == [True] * 4
    assert all(r["overlapped"] for r in reports)


def test_with_clipping_the_pass_reads_ahead_during_the_backward(tmp_path):
    # With gradient_clipping step() needs the step's own norm before it updates anything: the
    # engine's pass opens in the backward all the same but only reads the state ahead
    # (StepReport read_ahead), and the parameters are the bits of the sequential step's.
    batches = make_batches(4)
    params = {}
    for overlap in (False, True):
        config = offloaded_config(tmp_path / f"clip{overlap}", overlap, clipping=1.0)
        engine, _, _, _ = open_engine(config)
        reports = step_reports(engine, batches)
        params[overlap] = engine.read_parameter("transformer.wte.weight")
        assert [r["read_ahead"] for r in reports] == [overlap] * 4
        assert not any(r["in_backward"] for r in reports)
    assert torch.equal(params[False], params[True])


# The refusal of a backward the engine did not run: it names a parameter and the call to use.
STRAY = (r"failed_precondition: .*parameter '[0-9.a-z]+'.*"
         r"call engine.backward\(loss\) instead of loss.backward\(\)")


@pytest.mark.parametrize("stage,offload", [(1, "none"), (2, "cpu"), (2, "none"), (3, "cpu")])
def test_loss_backward_instead_of_engine_backward_is_refused(stage, offload, tmp_path):
    """A step after loss.backward() with no engine.backward() since the last step is refused
    (the engine has no gradient to apply); the gradients were dropped, so with one rank training
    goes on as if that backward had not happened."""
    batches = mlp_batches(3)
    reference = make_mlp()
    expected = train_mlp_torch(reference, batches[1:])
    model = make_mlp()
    engine, _, _, _ = zinf.torch.initialize(model=model, config=mlp_config(stage, offload,
                                                                           tmp_path))
    mlp_loss(engine, batches[0]).backward()
    with pytest.raises(zinf.Error, match=STRAY):
        engine.step()
    assert engine.global_steps == 0 and all(p.grad is None for p in model.parameters())
    assert train_mlp_zinf(engine, batches[1:]) == pytest.approx(expected, rel=1e-5)
    assert_mlp_matches(engine, reference)


@pytest.mark.parametrize("stage", [1, 3])
def test_another_backward_through_the_model_is_not_a_mistake(stage, tmp_path):
    """Backward passes engine.backward() did not run, beside the engine's own: a gradient with
    respect to the inputs (torch.autograd.grad, as for a gradient penalty), and a second engine's
    loss whose backward runs through this model (a GAN's generator through its discriminator).
    Neither is refused, neither reaches this engine's step, and the training equals torch's."""
    batches = mlp_batches(3)
    reference = make_mlp()
    expected = train_mlp_torch(reference, batches)
    model = make_mlp()
    engine, _, _, _ = zinf.torch.initialize(model=model, config=mlp_config(stage, "cpu",
                                                                           tmp_path))
    x, _ = batches[0]
    x = x.clone().requires_grad_(True)
    (gx,) = torch.autograd.grad(engine(x).pow(2).sum(), x)
    want = torch.autograd.grad(make_mlp()(x).pow(2).sum(), x)[0]  # the untrained model's
    assert torch.allclose(gx, want, rtol=1e-5, atol=1e-6)
    # Another model's loss through this one: only the other model's parameters would learn.
    other = torch.nn.Linear(x.shape[1], x.shape[1])
    engine(other(x.detach())).pow(2).mean().backward()
    assert other.weight.grad is not None
    assert all(p.grad is None for p in model.parameters())
    assert train_mlp_zinf(engine, batches) == pytest.approx(expected, rel=1e-5)
    assert_mlp_matches(engine, reference)


@pytest.mark.parametrize("zero,key,why", [
    ({"stage": 2, "offload_optimizer": "cpu"}, "zero_optimization.offload_optimizer",
     ".* is not an? "),
    ({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": 5}},
     "zero_optimization.offload_optimizer.nvme_path", ".* is not an? "),
    # DeepSpeed's older boolean form: the message says what to write instead.
    (True, "zero_optimization",
     "true is DeepSpeed's older form .*\"zero_optimization\": {\"stage\": 1}"),
    (3, "zero_optimization", ".* is not an? "),
])
def test_a_config_value_of_the_wrong_type_is_named(zero, key, why):
    config = mlp_config(1)
    config["zero_optimization"] = zero
    with pytest.raises(zinf.Error, match=f"invalid_argument: {key}: {why}"):
        zinf.torch.initialize(model=make_mlp(), config=config)


def test_deepspeed_engine_accessors(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    config = mlp_config(1)
    config["gradient_accumulation_steps"] = 3
    engine, _, _, _ = zinf.torch.initialize(model=make_mlp(), config=config)
    assert engine.gradient_accumulation_steps() == 3
    assert engine.train_micro_batch_size_per_gpu() == config["train_micro_batch_size_per_gpu"]
    assert engine.train_batch_size() == 3 * config["train_micro_batch_size_per_gpu"]
    assert engine.local_rank == 3
    assert "export_safetensors" in zinf.torch.__all__
    namespace = {}
    exec("from zinf.torch import *", namespace)
    assert namespace["export_safetensors"] is zinf.torch.export_safetensors


def test_load_checkpoint_without_a_checkpoint_warns_naming_the_path(tmp_path):
    engine, _, _, _ = zinf.torch.initialize(model=make_mlp(), config=mlp_config(1))
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("not a checkpoint")
    for name, why in [("missing", "does not exist"), ("file", "not a directory"),
                      ("empty", "no file 'latest'")]:
        path = str(tmp_path / name)
        with pytest.warns(UserWarning, match=f"nothing loaded from '{path}': .*{why}"):
            assert engine.load_checkpoint(path) == (None, None)


def truncate_swap_files(swap):
    """Cuts every swap file under `swap` to 0 bytes: the next read of the optimizer state fails
    (an I/O error, sticky in the engine)."""
    files = [path for path in swap.rglob("*") if path.is_file()]
    assert files, f"no swap file under {swap}"
    for path in files:
        os.truncate(path, 0)


@pytest.mark.parametrize("failure", ["swap", "schedule", "swap_overlapped", "lr"])
def test_after_a_failed_step_backward_and_step_raise_its_error(failure, tmp_path, monkeypatch):
    """A step that raised leaves its micro-batches in the engine: the next engine.backward()
    raises the step's error again, chained to it, its message first, and not the refusal of a
    micro-batch past gradient_accumulation_steps that hid it (the caller did call step()); a
    step() with its micro-batches to apply calls the engine again, which raises the same error,
    or, for a step refused before anything changed (an lr the engine cannot take), applies them
    once the cause is gone. Where the engine failed after the step was counted (its optimizer
    pass, overlapped with the backward, failed after step() handed it the step), the step()
    after it, with nothing to apply, raises it too instead of returning as if all were well."""
    batches = mlp_batches(9)
    if failure.startswith("swap"):
        # The optimizer state on NVMe, its swap file cut short under the engine after one step.
        config = mlp_config(2, "nvme", tmp_path / "swap")
        config["zinf"]["overlap_step"] = failure == "swap_overlapped"
        engine, _, _, _ = zinf.torch.initialize(model=make_mlp(), config=config)
        train_mlp_zinf(engine, batches[:1])
        truncate_swap_files(tmp_path / "swap")
        steps_before = 1
    elif failure == "lr":
        engine, _, _, _ = zinf.torch.initialize(model=make_mlp(), config=mlp_config(1))
        train_mlp_zinf(engine, batches[:1])
        steps_before = 1
    else:
        # OneCycle's momentum after the cycle, 0.9 x (1 + 0.05 x iterations past it), reaches
        # 1 (Adam's beta1 must stay below) at the 8th step.
        config = mlp_config(1)
        config["scheduler"] = {"type": "OneCycle", "params": {
            "cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 2,
            "decay_step_size": 1, "decay_mom_rate": 0.05}}
        engine, _, _, _ = zinf.torch.initialize(model=make_mlp(), config=config)
        train_mlp_zinf(engine, batches[:7])
        steps_before = 7
    engine.backward(mlp_loss(engine, batches[steps_before]))
    if failure == "lr":
        engine.optimizer.param_groups[0]["lr"] = float("nan")
    error_type = ValueError if failure == "lr" else zinf.Error
    with pytest.raises(error_type, match="^io_error: " if failure.startswith("swap") else None) \
            as failed:
        engine.step()
    counted = failure == "swap_overlapped"
    assert engine.global_steps == steps_before + counted
    # The error raised again passes through no guard that aborts the communicator on an
    # exception (in a run of several ranks, a backward after a refused step would abort it, and
    # the step could never apply).
    guarded = engine._aborting_on_error
    aborting = []

    @contextlib.contextmanager
    def recording(what):
        try:
            with guarded(what):
                yield
        except BaseException:
            aborting.append(what)
            raise

    monkeypatch.setattr(engine, "_aborting_on_error", recording)
    with pytest.raises(error_type) as again:
        engine.backward(mlp_loss(engine, batches[steps_before + 1]))
    assert aborting == []
    monkeypatch.undo()
    message = str(again.value)
    assert message.startswith(f"{failed.value} -- engine.backward(): raised again, the last "
                              f"engine.step() having raised this {error_type.__name__}; ")
    assert ("the step was counted, and the engine failed after it" if counted else
            "holds that step's 1 micro-batch(es)") in message
    assert "micro-batch 2" not in message
    assert again.value.__cause__ is failed.value
    assert engine.micro_steps == steps_before + 1
    if failure == "lr":
        # The cause gone, the step applies the micro-batch it holds, and training goes on as
        # if the step had not been refused.
        engine.optimizer.param_groups[0]["lr"] = LR
        engine.step()
        assert engine.was_step_applied() and engine.global_steps == steps_before + 1
        train_mlp_zinf(engine, batches[steps_before + 1:steps_before + 2])
        reference = make_mlp()
        train_mlp_torch(reference, batches[:steps_before + 2])
        assert_mlp_matches(engine, reference)
        return
    with pytest.raises(zinf.Error) as stepped:
        engine.step()
    if counted:
        assert str(stepped.value) == message.replace("-- engine.backward():",
                                                     "-- engine.step():", 1)
        assert stepped.value.__cause__ is failed.value
    else:
        assert str(stepped.value) == str(failed.value)
    assert engine.global_steps == steps_before + counted


@pytest.mark.parametrize("refusal", ["no_gradients", "lr"])
def test_a_step_refused_with_nothing_to_apply_leaves_training_going(refusal):
    """optimizer.step() right after engine.step() has nothing to apply: the engine refuses it
    (no gradients were reduced, or first the lr it cannot take) before anything changed and
    without counting it. That refusal is the call's alone: the next backward() and step() train
    on, to the values of a run without the call."""
    batches = mlp_batches(3)
    engine, optimizer, _, _ = zinf.torch.initialize(model=make_mlp(), config=mlp_config(1))
    train_mlp_zinf(engine, batches[:1])
    if refusal == "lr":
        optimizer.param_groups[0]["lr"] = float("nan")
    with pytest.raises(ValueError if refusal == "lr" else zinf.Error,
                       match="lr nan" if refusal == "lr" else
                       "^failed_precondition: step: no gradients were reduced"):
        optimizer.step()
    optimizer.param_groups[0]["lr"] = LR
    assert engine.global_steps == 1
    train_mlp_zinf(engine, batches[1:])
    assert engine.global_steps == 3
    reference = make_mlp()
    train_mlp_torch(reference, batches)
    assert_mlp_matches(engine, reference)
