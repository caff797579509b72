"""What a DeepSpeed training script calls, ported by changing its import: the engine's accessors
(the stage, the dtypes, whether a step was applied, the skipped steps, the samples, the gradient
norm, the accumulation boundary), a torch scheduler across an fp16 overflow, the training data
loader, `args.deepspeed_config`, load_checkpoint's options, the zero_to_fp32 functions,
save_16bit_model and the consolidated 16-bit state dict, set_gradient_accumulation_boundary, the
offload, dtype and momentum accessors, and init_distributed. Each expected value is DeepSpeed's
(deepspeed/runtime/engine.py and dataloader.py, deepspeed/utils/zero_to_fp32.py,
deepspeed/comm/comm.py), written out in the test."""
import argparse
import datetime
import json
import warnings
from collections import OrderedDict

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

import zinf.torch
from conftest import (BETAS, CLIP, EPS, LR, WEIGHT_DECAY, make_batches, make_mlp, make_model,
                      mlp_batches, mlp_config, mlp_loss)


def fp16_config(accumulation=2):
    config = mlp_config(2, "cpu")
    config["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    config["gradient_accumulation_steps"] = accumulation
    return config


def test_step_accessors_follow_deepspeed():
    config = fp16_config()
    engine, optimizer, _, _ = zinf.torch.initialize(model=make_mlp(), config=config)
    micro, accumulation = config["train_micro_batch_size_per_gpu"], 2
    assert engine.zero_optimization_stage() == 2
    assert engine.fp16_enabled() and not engine.bfloat16_enabled()
    assert engine.gradient_clipping() == config["gradient_clipping"]
    assert engine.get_global_grad_norm() is None
    assert engine.global_samples == 0 and engine.skipped_steps == 0
    batches = [(x.half(), y.half()) for x, y in mlp_batches(8)]
    for calls, batch in enumerate(batches):
        # DeepSpeed: (micro_steps + 1) % gradient_accumulation_steps == 0, where micro_steps
        # counts engine.step() calls; so the answer is the micro-batch in progress', from before
        # its forward until its step().
        boundary = (calls + 1) % accumulation == 0
        assert engine.is_gradient_accumulation_boundary() == boundary, calls
        overflow = calls == 5
        loss = mlp_loss(engine, batch).float() * (float("inf") if overflow else 1.0)
        assert engine.is_gradient_accumulation_boundary() == boundary, calls
        engine.backward(loss)
        assert engine.is_gradient_accumulation_boundary() == boundary, calls
        engine.step()
        applied_steps = (calls + 1) // accumulation
        assert engine.global_steps == applied_steps
        assert engine.global_samples == applied_steps * micro * accumulation
        # DeepSpeed's was_step_applied() is false after a step() that only accumulated, and
        # after one that skipped the update for an overflow; optimizer.overflow is the last
        # update's.
        assert engine.was_step_applied() == (boundary and not overflow), calls
        assert engine.skipped_steps == (1 if calls >= 5 else 0)
        assert optimizer.overflow == (calls in (5, 6)), calls
        if boundary and not overflow:
            assert engine.get_global_grad_norm() == engine.last_step_report["grad_norm"]
            applied_norm = engine.get_global_grad_norm()
        elif boundary:
            # DeepSpeed's ZeRO optimizers keep the last applied step's norm over an overflow.
            assert engine.get_global_grad_norm() == applied_norm
    assert engine.last_step_report["skipped"] is False


def test_a_torch_scheduler_does_not_step_on_a_skipped_step():
    # DeepSpeed's _take_model_step steps the lr_scheduler only when the optimizer did not
    # overflow, so a skipped step does not move the schedule.
    engine, _, _, scheduler = zinf.torch.initialize(
        model=make_mlp(), config=fp16_config(accumulation=1),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (k + 1)))
    for index, (x, y) in enumerate(mlp_batches(4)):
        loss = mlp_loss(engine, (x.half(), y.half())).float()
        engine.backward(loss * float("inf") if index == 1 else loss)
        engine.step()
    assert engine.skipped_steps == 1 and engine.global_steps == 4
    assert scheduler.last_epoch == 3
    assert engine.get_lr() == [pytest.approx(engine.optimizer.defaults["lr"] / 4)]


def test_the_training_data_loader_shuffles_and_partitions_as_deepspeeds():
    dataset = TensorDataset(torch.arange(40, dtype=torch.float32).unsqueeze(1))
    config = mlp_config(1)
    engine, _, loader, _ = zinf.torch.initialize(model=make_mlp(), config=config,
                                                 training_data=dataset)
    batch = config["train_micro_batch_size_per_gpu"]

    def order(sampler_epoch, replicas=1, rank=0):
        sampler = DistributedSampler(dataset, num_replicas=replicas, rank=rank)
        sampler.set_epoch(sampler_epoch)
        return list(sampler)

    def seen(data):
        return [int(v) for (x,) in data for v in x.flatten()]

    assert len(loader) == 40 // batch
    # DeepSpeed's DeepSpeedDataLoader: a DistributedSampler over the data-parallel ranks (shuffled,
    # seed 0) whose epoch advances with each pass over the data.
    assert seen(loader) == order(0)
    assert seen(loader) == order(1)
    loader.sampler.set_epoch(7)
    assert seen(loader) == order(7)
    assert seen(loader) == order(8)
    # Under mpirun each rank reads its own share.
    for rank in range(2):
        shard = zinf.torch._training_loader(dataset, batch, world_size=2, rank=rank)
        assert seen(shard) == order(0, 2, rank)


def test_dataloader_drop_last_drops_the_partial_last_batch():
    dataset = TensorDataset(torch.arange(41, dtype=torch.float32).unsqueeze(1))
    config = mlp_config(1)
    batch = config["train_micro_batch_size_per_gpu"]
    assert 41 % batch != 0
    _, _, kept, _ = zinf.torch.initialize(model=make_mlp(), config=config, training_data=dataset)
    assert len(kept) == -(-41 // batch)
    config["dataloader_drop_last"] = True
    _, _, dropped, _ = zinf.torch.initialize(model=make_mlp(), config=config,
                                             training_data=dataset)
    assert len(dropped) == 41 // batch
    assert all(len(x) == batch for (x,) in dropped)


def test_training_data_without_a_batch_size_is_refused():
    # DeepSpeed refuses a config with neither train_micro_batch_size_per_gpu nor
    # train_batch_size (deepspeed/runtime/config.py, _batch_assertion); zinf's engine runs
    # micro-batches of 1 then, and the loader read batches of 1 silently before.
    dataset = TensorDataset(torch.arange(12, dtype=torch.float32).unsqueeze(1))
    config = mlp_config(1)
    del config["train_micro_batch_size_per_gpu"]
    with pytest.raises(ValueError, match="neither train_micro_batch_size_per_gpu nor "
                                         "train_batch_size"):
        zinf.torch.initialize(model=make_mlp(), config=config, training_data=dataset)
    config["train_batch_size"] = 3
    _, _, loader, _ = zinf.torch.initialize(model=make_mlp(), config=config,
                                            training_data=dataset)
    assert [len(x) for (x,) in loader] == [3] * 4


def test_initialize_reads_the_config_from_args(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(mlp_config(2)))
    parser = zinf.torch.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    assert args.deepspeed and args.deepspeed_config == str(path)
    engine, _, _, _ = zinf.torch.initialize(args=args, model=make_mlp())
    assert engine.zero_optimization_stage() == 2
    # DeepSpeed refuses a config in both places.
    with pytest.raises(ValueError, match="args.deepspeed_config .* and config="):
        zinf.torch.initialize(args=args, model=make_mlp(), config=mlp_config(1))
    with pytest.raises(ValueError, match="--deepspeed_config"):
        zinf.torch.initialize(args=argparse.Namespace(deepspeed_config=None), model=make_mlp())


def test_load_checkpoint_refuses_the_options_it_cannot_honour(tmp_path):
    engine, _, _, _ = zinf.torch.initialize(model=make_mlp(), config=mlp_config(1))
    for batch in mlp_batches(2):
        engine.backward(mlp_loss(engine, batch))
        engine.step()
    assert engine.save_checkpoint(str(tmp_path), exclude_frozen_parameters=True)
    for option in [{"load_module_only": True}, {"load_optimizer_states": False},
                   {"load_lr_scheduler_states": False}, {"custom_load_fn": print}]:
        with pytest.raises(NotImplementedError,
                           match=f"{next(iter(option))}.*export_safetensors.*GatheredParameters"):
            engine.load_checkpoint(str(tmp_path), **option)
    path, client = engine.load_checkpoint(str(tmp_path), load_module_strict=True,
                                          load_optimizer_states=True,
                                          load_lr_scheduler_states=True, load_module_only=False)
    assert path == str(tmp_path / "global_step2") and client == {}
    # load_module_strict=False (the Hugging Face Trainer's for a PEFT model) loads the same.
    path, client = engine.load_checkpoint(str(tmp_path), load_module_strict=False)
    assert path == str(tmp_path / "global_step2") and client == {}


def test_the_engine_reports_where_and_how_it_runs():
    config = mlp_config(1)
    config["steps_per_print"] = 25
    engine, _, _, _ = zinf.torch.initialize(model=make_mlp(), config=config)
    x, y = mlp_batches(1)[0]
    assert engine.device == torch.device("cpu")  # DeepSpeed's on its CPU accelerator
    assert engine(x.to(engine.device)).shape == y.shape
    assert engine.dp_world_size == engine.world_size == 1
    assert engine.steps_per_print() == 25
    assert engine.zero_optimization_stage() == 1 and engine.zero_optimization()
    assert not engine.fp16_enabled() and not engine.bfloat16_enabled()
    # Stage 0 (no partitioning), which zinf runs as stage 1: the stage reported is the config's.
    config["zero_optimization"] = {"stage": 0}
    engine, _, _, _ = zinf.torch.initialize(model=make_mlp(), config=config)
    assert engine.zero_optimization_stage() == 0 and not engine.zero_optimization()
    assert engine.stage == 1


def test_zero_to_fp32_helpers_give_the_masters_under_every_name(tmp_path):
    # The example's GPT-2 ties lm_head.weight to transformer.wte.weight.
    engine, _, _, _ = zinf.torch.initialize(model=make_model(), config=mlp_config(3))
    for ids, labels in make_batches(2):
        engine.backward(engine(input_ids=ids, labels=labels).loss)
        engine.step()
    engine.save_checkpoint(str(tmp_path))
    weights = zinf.torch.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    names = [name for name, _ in engine.module.named_parameters()]
    assert sorted(weights) == sorted(names)
    for name in names:
        assert weights[name].dtype == torch.float32
        assert torch.equal(weights[name], engine.read_parameter(name)), name
    fresh = make_model()
    loaded = zinf.torch.load_state_dict_from_zero_checkpoint(fresh, str(tmp_path))
    assert loaded is fresh
    assert torch.equal(fresh.lm_head.weight, engine.read_parameter("transformer.wte.weight"))
    for name, param in fresh.named_parameters():
        assert torch.equal(param.detach(), engine.read_parameter(name)), name
    with pytest.raises(KeyError, match="'extra.weight' is not in the checkpoint"):
        bigger = make_model()
        bigger.extra = torch.nn.Linear(2, 2)
        zinf.torch.load_state_dict_from_zero_checkpoint(bigger, str(tmp_path))


def bf16_stage3_engine_after_a_step():
    config = mlp_config(3)
    config["bf16"] = {"enabled": True}
    engine, _, _, _ = zinf.torch.initialize(model=make_model(), config=config)
    for ids, labels in make_batches(1):
        engine.backward(engine(input_ids=ids, labels=labels).loss)
        engine.step()
    return engine


def test_save_16bit_model_writes_the_whole_state_dict(tmp_path):
    engine = bf16_stage3_engine_after_a_step()
    assert engine.save_16bit_model(str(tmp_path / "out"))
    state = torch.load(tmp_path / "out" / "pytorch_model.bin")
    assert sorted(state) == sorted(make_model().state_dict())
    for name, _ in engine.module.named_parameters():
        assert state[name].dtype == torch.bfloat16
        assert torch.equal(state[name], engine.read_parameter(name).to(torch.bfloat16)), name
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])
    # deepspeed.zero's names
    assert zinf.torch.zero.GatheredParameters is zinf.torch.GatheredParameters
    assert zinf.torch.zero.Init is zinf.torch.Init


def test_the_consolidated_16bit_state_dict_is_the_models_in_bf16(tmp_path):
    # DeepSpeed's engine._zero3_consolidated_16bit_state_dict(), which Accelerate's get_state_dict
    # and Trainer's save_model call at stage 3: on rank 0 an OrderedDict in state_dict()'s order
    # (each module's parameters, its persistent buffers, then its children), a shared parameter
    # as the same tensor under each name; None on the other ranks; ValueError below stage 3.
    engine = bf16_stage3_engine_after_a_step()
    gathered_at_once = []
    acquire = engine._acquire

    def counting_acquire(module):
        acquire(module)
        gathered_at_once.append(sum(1 for c in engine._gather_count.values() if c))

    engine._acquire = counting_acquire
    state = engine._zero3_consolidated_16bit_state_dict()
    del engine._acquire
    # One module gathered at a time (GPT-2's lm_head gathers the embedding it shares).
    assert gathered_at_once and max(gathered_at_once) == 1
    assert type(state) is OrderedDict
    assert list(state) == list(make_model().state_dict())
    assert state["lm_head.weight"] is state["transformer.wte.weight"]
    for name, param in engine.module.named_parameters():
        assert state[name].dtype == torch.bfloat16
        assert torch.equal(state[name], engine.read_parameter(name).to(torch.bfloat16)), name
        with zinf.torch.GatheredParameters([param]):
            assert torch.equal(state[name], param.detach()), name
    # The exported bf16 safetensors of a checkpoint hold the same values.
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    zinf.torch.export_safetensors(str(tmp_path / "ckpt"), str(tmp_path / "w.safetensors"),
                                  dtype="bf16")
    for name, values in zinf.torch._read_safetensors(str(tmp_path / "w.safetensors")).items():
        assert torch.equal(state[name], values), name
    # DeepSpeed's answer: the config's key, false unless given.
    assert not engine.zero_gather_16bit_weights_on_model_save()
    engine._config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    assert engine.zero_gather_16bit_weights_on_model_save()
    engine.global_rank = 1
    assert engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True) is None
    below, _, _, _ = zinf.torch.initialize(model=make_mlp(), config=mlp_config(2))
    with pytest.raises(ValueError, match="requires ZeRO-3"):
        below._zero3_consolidated_16bit_state_dict()


def test_set_gradient_accumulation_boundary_steps_where_it_is_set():
    # DeepSpeed: is_gradient_accumulation_boundary() returns the value set, step() applies the
    # optimizer when it is true, and every micro-batch's loss is divided by the config's
    # gradient_accumulation_steps, however many micro-batches the step has. Accelerate sets it
    # before each backward, with a shorter accumulation at the end of an epoch.
    accumulation = 3
    config = mlp_config(2, "cpu")
    config["gradient_accumulation_steps"] = accumulation
    engine, _, _, _ = zinf.torch.initialize(model=make_mlp(), config=config)
    reference = make_mlp()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                  weight_decay=WEIGHT_DECAY)
    batches = iter(mlp_batches(17))
    for steps, sizes in enumerate([3, 2, 1, 3, 2], start=1):
        for index in range(sizes):
            last = index == sizes - 1
            engine.set_gradient_accumulation_boundary(last)
            assert engine.is_gradient_accumulation_boundary() == last
            batch = next(batches)
            engine.backward(mlp_loss(engine, batch))
            (mlp_loss(reference, batch) / accumulation).backward()
            engine.step()
            assert engine.was_step_applied() == last
        # The norm before clipping: clipping alone would hide a gradient of the wrong scale.
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        assert engine.get_global_grad_norm() == pytest.approx(float(norm), rel=1e-5)
        optimizer.step()
        optimizer.zero_grad()
        assert engine.global_steps == steps
        assert engine.global_samples == steps * engine.train_batch_size()
    # Counting again after a step cut short by hand: DeepSpeed's next boundary is where
    # micro_steps reaches a multiple of gradient_accumulation_steps, here after one micro-batch,
    # whose loss is divided by that count all the same.
    engine.set_gradient_accumulation_boundary(None)
    assert engine.micro_steps % accumulation == accumulation - 1
    assert engine.is_gradient_accumulation_boundary()
    batch = next(batches)
    engine.backward(mlp_loss(engine, batch))
    (mlp_loss(reference, batch) / accumulation).backward()
    engine.step()
    assert engine.was_step_applied()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
    assert engine.get_global_grad_norm() == pytest.approx(float(norm), rel=1e-5)
    optimizer.step()
    optimizer.zero_grad()
    for name, param in reference.named_parameters():
        assert torch.allclose(engine.read_parameter(name), param.detach(), rtol=1e-5,
                              atol=1e-6), name
    # A boundary with no backward since the last step applies nothing.
    engine.set_gradient_accumulation_boundary(True)
    steps_before = engine.global_steps
    engine.step()
    assert not engine.was_step_applied() and engine.global_steps == steps_before
    # More micro-batches than gradient_accumulation_steps in one step: DeepSpeed's sum of the
    # losses / gradient_accumulation_steps cannot be had from the engine's average.
    engine.set_gradient_accumulation_boundary(False)
    for _ in range(accumulation):
        engine.backward(mlp_loss(engine, next(batches)))
        engine.step()
    with pytest.raises(NotImplementedError, match="gradient_accumulation_steps"):
        engine.backward(mlp_loss(engine, next(batches)))


@pytest.mark.parametrize("optimizer, betas, eps", [("AdamW", (0.8, 0.99), 1e-7),
                                                   ("Adagrad", None, 1e-10),
                                                   ("Lion", (0.9, 0.98), None)])
def test_the_optimizers_groups_and_momentum_are_deepspeeds(optimizer, betas, eps):
    # get_mom() is DeepSpeed's: each group's "betas" (0.0 for a group without), as its
    # optimizers' param_groups hold them (Adagrad has none, Lion has no eps).
    config = mlp_config(1)
    params = {"lr": 1e-3, "weight_decay": 0.0}
    if betas is not None:
        params["betas"] = list(betas)
    if eps is not None:
        params["eps"] = eps
    config["optimizer"] = {"type": optimizer, "params": params}
    model = make_mlp()
    groups = [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")]},
              {"params": [p for n, p in model.named_parameters() if n.endswith("bias")],
               "lr": 2e-3}]
    engine, opt, _, _ = zinf.torch.initialize(model=model, config=config,
                                              model_parameters=groups)
    assert engine.get_mom() == ([tuple(betas)] * 2 if betas is not None else [0.0, 0.0])
    for group in opt.param_groups:
        assert ("betas" in group) == (betas is not None)
        assert group.get("eps") == eps
    assert engine.get_lr() == [1e-3, 2e-3]


def test_the_offload_and_dtype_accessors_are_deepspeeds(tmp_path):
    config = mlp_config(3, "nvme", tmp_path)
    config["bf16"] = {"enabled": True}
    engine, _, _, _ = zinf.torch.initialize(model=make_mlp(), config=config)
    # DeepSpeed's zero_offload_optimizer()/zero_offload_param(): the config's section (None
    # when absent); zero_cpu_offload(): the optimizer offloaded to "cpu".
    assert engine.zero_offload_optimizer().device == "nvme"
    assert engine.zero_offload_optimizer().nvme_path == str(tmp_path)
    assert engine.zero_offload_param().device == "nvme"
    assert engine.zero_offload_param().buffer_count == 5
    assert not engine.zero_cpu_offload()
    # (model dtype, gradient accumulation dtype): zinf accumulates gradients in fp32.
    assert engine.get_data_types() == (torch.bfloat16, torch.float32)
    assert engine.train_micro_batch_size_per_gpu() == config["train_micro_batch_size_per_gpu"]
    engine.zero_grad()
    assert all(p.grad is None for p in engine.module.parameters())

    config = mlp_config(2, "cpu")
    del config["zero_optimization"]["offload_param"]
    engine, _, _, _ = zinf.torch.initialize(model=make_mlp(), config=config)
    assert engine.zero_offload_optimizer().device == "cpu" and engine.zero_cpu_offload()
    assert engine.zero_offload_param() is None
    assert engine.get_data_types() == (torch.float32, torch.float32)
    adamw = {"type": "AdamW", "params": {"lr": LR}}
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": adamw,
              "zero_optimization": {"stage": 2, "cpu_offload": True}}
    engine, _, _, _ = zinf.torch.initialize(model=make_mlp(), config=config)
    assert engine.zero_offload_optimizer().device == "cpu" and engine.zero_cpu_offload()
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": adamw, "fp16": {"enabled": True}}
    engine, _, _, _ = zinf.torch.initialize(model=make_mlp(), config=config)
    assert engine.zero_offload_optimizer() is None and not engine.zero_cpu_offload()
    assert engine.get_data_types() == (torch.float16, torch.float32)


def test_init_distributed_leaves_torch_distributed_to_the_script(monkeypatch):
    # deepspeed.init_distributed's arguments are taken; zinf's ranks come from its own
    # communicator, so torch.distributed stays uninitialised, said aloud with several ranks.
    for key in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert zinf.torch.init_distributed(
            dist_backend="gloo", auto_mpi_discovery=True, distributed_port=29500, verbose=False,
            timeout=datetime.timedelta(minutes=30), init_method=None, dist_init_required=None,
            config=None, rank=-1, world_size=-1) is None
    assert not torch.distributed.is_initialized()
    engine, _, _, _ = zinf.torch.initialize(model=make_mlp(), config=mlp_config(1))
    assert engine.world_size == 1
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    with pytest.warns(UserWarning, match="torch.distributed.init_process_group"):
        zinf.torch.init_distributed()
    assert not torch.distributed.is_initialized()
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(NotImplementedError, match="mpirun"):
        zinf.torch.init_distributed()


@pytest.mark.parametrize("stage", [1, 3])
def test_a_checkpoint_keeps_the_models_buffers(stage, tmp_path):
    """DeepSpeed's checkpoint holds the module's state_dict, buffers included: BatchNorm's
    running statistics and count come back, so the resumed model evaluates as the saved one."""
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                   torch.nn.Linear(8, 1))

    config = mlp_config(stage)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 4, generator=generator) + 3 for _ in range(3)]
    engine, _, _, _ = zinf.torch.initialize(model=make(), config=config)
    for x in batches:
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    batch_norm = engine.module[1]
    assert int(batch_norm.num_batches_tracked) == 3
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    engine.eval()
    probe = torch.randn(5, 4, generator=generator)
    with torch.no_grad():
        expected = engine(probe).clone()

    resumed, _, _, _ = zinf.torch.initialize(model=make(), config=config)
    assert int(resumed.module[1].num_batches_tracked) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.load_checkpoint(str(tmp_path / "ckpt"))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(resumed.module[1], name), getattr(batch_norm, name)), name
    resumed.eval()
    with torch.no_grad():
        assert torch.equal(resumed(probe), expected)


def test_a_backward_past_the_steps_micro_batches_is_refused_and_the_engine_goes_on():
    # Two engine.backward() calls where the config takes one per step: the second is refused
    # before autograd runs, and the step() after it applies the first alone, as torch would.
    engine, _, _, _ = zinf.torch.initialize(model=make_mlp(), config=mlp_config(2, "cpu"))
    reference = make_mlp()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                  weight_decay=WEIGHT_DECAY)
    first, second = mlp_batches(2)
    engine.backward(mlp_loss(engine, first))
    with pytest.raises(NotImplementedError,
                       match=r"micro-batch 2 .* over gradient_accumulation_steps \(1\): call "
                             r"engine.step\(\) after each engine.backward\(\)"):
        engine.backward(mlp_loss(engine, second))
    engine.step()
    assert engine.was_step_applied() and engine.global_steps == 1
    mlp_loss(reference, first).backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
    optimizer.step()
    assert engine.get_global_grad_norm() is not None
    for name, expected in reference.named_parameters():
        got = engine.read_parameter(name)
        assert torch.allclose(got, expected.detach(), rtol=1e-5, atol=1e-7), name


def test_a_config_without_an_optimizer_says_what_trains():
    config = mlp_config(1)
    del config["optimizer"]
    with pytest.warns(UserWarning, match=r"no \"optimizer\" section .* AdamW .*lr 1e-3"):
        engine, optimizer, _, _ = zinf.torch.initialize(model=make_mlp(), config=config)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    assert optimizer.param_groups[0]["weight_decay"] == pytest.approx(0.01)


def test_a_resume_with_other_gradient_accumulation_steps_takes_whole_steps(tmp_path):
    # A run at gradient_accumulation_steps 2 resumed at 4 (two ranks' run resumed on one with
    # the same global batch): the first step after the load is applied after 4 micro-batches,
    # each divided by 4, as a fresh engine at 4 would take it.
    def config(accumulation):
        config = mlp_config(1)
        config["gradient_accumulation_steps"] = accumulation
        return config

    batches = mlp_batches(10)
    engine, _, _, _ = zinf.torch.initialize(model=make_mlp(), config=config(2))
    for batch in batches[:6]:
        engine.backward(mlp_loss(engine, batch))
        engine.step()
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    resumed, _, _, _ = zinf.torch.initialize(model=make_mlp(), config=config(4))
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    applied = []
    for batch in batches[6:]:
        resumed.backward(mlp_loss(resumed, batch))
        resumed.step()
        applied.append(resumed.was_step_applied())
    assert applied == [False, False, False, True]
    assert resumed.global_steps == 4


def test_an_overflow_at_the_loss_scales_floor_raises_and_training_goes_on():
    # DeepSpeed raises when the gradients overflow with the scale already at min_loss_scale; zinf
    # raises too, having skipped the step, and a caller that catches it trains on (the state on
    # the device: the path whose error used to stick).
    config = mlp_config(2)
    config["fp16"] = {"enabled": True, "initial_scale_power": 0, "min_loss_scale": 1,
                      "hysteresis": 1}
    engine, _, _, _ = zinf.torch.initialize(model=make_mlp(), config=config)
    first, second = [(x.half(), y.half()) for x, y in mlp_batches(2)]
    engine.backward(mlp_loss(engine, first).float() * float("inf"))
    with pytest.raises(zinf.torch.Error, match="fp16.min_loss_scale"):
        engine.step()
    assert (engine.global_steps, engine.skipped_steps) == (1, 1)
    assert not engine.was_step_applied()
    engine.backward(mlp_loss(engine, second).float())
    engine.step()
    assert engine.was_step_applied()
    assert (engine.global_steps, engine.skipped_steps) == (2, 1)


def test_the_bf16_sections_old_name_computes_in_bf16():
    # DeepSpeed reads the section "bfloat16" as "bf16" where the config has no "bf16"
    # (deepspeed/runtime/precision_config.py, get_bfloat16_config): the model computes in bf16
    # and trains as with "bf16". (The model was left in fp32 before, and the engine refused its
    # parameters: "dtype f32, but bf16.enabled is true".)
    masters = {}
    for key in ("bf16", "bfloat16"):
        config = mlp_config(2)
        del config["bf16"]
        config[key] = {"enabled": True}
        engine, _, _, _ = zinf.torch.initialize(model=make_mlp(), config=config)
        assert engine.bfloat16_enabled() and not engine.fp16_enabled()
        assert engine.get_data_types() == (torch.bfloat16, torch.float32)
        assert all(p.dtype == torch.bfloat16 for p in engine.module.parameters())
        for x, y in mlp_batches(3):
            engine.backward(mlp_loss(engine, (x.bfloat16(), y.bfloat16())).float())
            engine.step()
        masters[key] = {name: engine.read_parameter(name)
                        for name, _ in engine.module.named_parameters()}
        engine.destroy()
    assert masters["bfloat16"].keys() == masters["bf16"].keys()
    for name, value in masters["bf16"].items():
        assert torch.equal(masters["bfloat16"][name], value), name


def test_backward_returns_deepspeeds_loss():
    # DeepSpeed's engine.backward returns the loss it ran the backward on: loss.float() /
    # gradient_accumulation_steps when that is above 1, else the loss itself; with
    # scale_wrt_gas=False the loss as given (deepspeed/runtime/engine.py, backward and
    # _scale_loss_by_gas). It returned the loss as given at every accumulation before.
    import zinf.deepspeed_compat as compat

    for accumulation in (1, 3):
        config = mlp_config(2)
        config["gradient_accumulation_steps"] = accumulation
        engine, _, _, _ = zinf.torch.initialize(model=make_mlp(), config=config)
        ds_engine, _, _, _ = compat.initialize(model=make_mlp(), config=config,
                                               dist_init_required=False)
        for batch in mlp_batches(accumulation):
            loss = mlp_loss(engine, batch)
            returned = engine.backward(loss)
            if accumulation == 1:
                assert returned is loss
            else:
                assert returned.dtype == torch.float32
                assert torch.equal(returned, loss.float() / accumulation)
            engine.step()
            loss = mlp_loss(ds_engine, batch)
            returned = ds_engine.backward(loss)
            assert torch.equal(returned, loss / accumulation if accumulation > 1 else loss)
            ds_engine.step()
        loss = mlp_loss(ds_engine, mlp_batches(1)[0])
        assert ds_engine.backward(loss, scale_wrt_gas=False) is loss
        engine.destroy()
        ds_engine.destroy()


@pytest.mark.parametrize("stage", [2, 3])
def test_fp16_auto_cast_casts_the_forwards_inputs(stage):
    # DeepSpeed's forward with fp16.auto_cast casts its positional inputs to fp16
    # (deepspeed/runtime/engine.py, forward and _cast_inputs_half), so a script may pass fp32
    # batches to the fp16 model. The key was accepted and ignored before: torch raised "mat1 and
    # mat2 must have the same dtype".
    config = mlp_config(stage)
    config["fp16"] = {"enabled": True, "auto_cast": True, "initial_scale_power": 8}
    engine, _, _, _ = zinf.torch.initialize(model=make_mlp(), config=config)
    x, y = mlp_batches(1)[0]
    out = engine(x)
    assert out.dtype == torch.float16
    assert torch.equal(out, engine(x.half()))
    assert x.dtype == torch.float32  # the caller's tensor is not changed
    engine.backward((out.float() - y).pow(2).mean())
    engine.step()
    assert engine.was_step_applied()
    # An integer input keeps its dtype (DeepSpeed's .half() would cast token ids too).
    embedding = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2))
    engine, _, _, _ = zinf.torch.initialize(model=embedding, config=config)
    ids = torch.tensor([[1, 2, 3]])
    assert engine(ids).dtype == torch.float16
    config["fp16"]["auto_cast"] = False
    engine, _, _, _ = zinf.torch.initialize(model=make_mlp(), config=config)
    with pytest.raises(RuntimeError, match="dtype"):
        engine(x)


def test_fp16_auto_cast_casts_inside_lists_dicts_and_named_tuples():
    # _cast_inputs_half (fp16.auto_cast's cast of the forward's inputs) rebuilds the containers
    # it goes through: the floating-point tensors in them come back as fp16, integer ones as
    # they were, and the caller's containers still hold their own fp32 tensors.
    from collections import namedtuple

    from zinf.torch import _cast_inputs_half

    Batch = namedtuple("Batch", ["x", "ids"])
    x, _ = mlp_batches(1)[0]
    ids = torch.randint(0, 10, (4, 3), generator=torch.Generator().manual_seed(5))
    as_list, as_dict, as_tuple = [x, ids], {"x": x, "ids": ids}, Batch(x, ids)
    cast = _cast_inputs_half(([as_list], as_dict, as_tuple))
    (cast_list,), cast_dict, cast_tuple = cast
    assert type(cast_list) is list and type(cast_dict) is dict and type(cast_tuple) is Batch
    for half, integer in [cast_list, (cast_dict["x"], cast_dict["ids"]), cast_tuple]:
        assert half.dtype == torch.float16 and torch.equal(half, x.half())
        assert integer is ids
    assert as_list[0] is x and as_dict["x"] is x and as_tuple.x is x
    assert x.dtype == torch.float32


def test_deepspeed_initialize_reads_the_config_as_deepspeed_does(tmp_path):
    # deepspeed.initialize refuses a config in args.deepspeed_config and in config= (or
    # config_params=), and one in neither (deepspeed/__init__.py, _parse_args / DeepSpeedConfig).
    # zinf.deepspeed_compat's took config= silently over args before, and without any config
    # raised a TypeError about None.
    import zinf.deepspeed_compat as compat

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(mlp_config(2)))
    args = argparse.Namespace(deepspeed_config=str(path), local_rank=0)
    engine, _, _, _ = compat.initialize(args=args, model=make_mlp(), dist_init_required=False)
    assert engine.zero_optimization_stage() == 2
    for keyword in ("config", "config_params"):
        # The message names the keyword given.
        with pytest.raises(ValueError, match=f"args.deepspeed_config .* and {keyword}= were"):
            compat.initialize(args=args, model=make_mlp(), dist_init_required=False,
                              **{keyword: mlp_config(1)})
    with pytest.raises(ValueError, match="no config.*--deepspeed_config"):
        compat.initialize(args=argparse.Namespace(deepspeed_config=None), model=make_mlp(),
                          dist_init_required=False)


def test_deepspeed_backward_takes_deepspeeds_arguments_in_their_order(caplog):
    # DeepSpeed's backward(loss, allreduce_gradients=True, release_loss=False,
    # retain_graph=False, scale_wrt_gas=True): the first two are accepted and do nothing (a
    # warning when allreduce_gradients is False). They were refused before, and a second
    # positional argument was taken as retain_graph.
    import zinf.deepspeed_compat as compat

    engines = [compat.initialize(model=make_mlp(), config=mlp_config(2),
                                 dist_init_required=False)[0] for _ in range(2)]
    for batch in mlp_batches(2):
        engines[0].backward(mlp_loss(engines[0], batch))
        loss = mlp_loss(engines[1], batch)
        caplog.clear()  # each backward's own warning, not the first one's
        with caplog.at_level("WARNING", logger="DeepSpeed"):
            engines[1].backward(loss, False, True)
        assert "allreduce_gradients is deprecated" in caplog.text
        # The graph was freed (retain_graph stayed False).
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            loss.backward()
        for engine in engines:
            engine.step()
    for name, _ in engines[0].module.named_parameters():
        assert torch.equal(engines[0].read_parameter(name), engines[1].read_parameter(name))


@pytest.mark.parametrize("stage", [2, 3])
def test_gathered_parameters_leaves_out_a_missing_bias(stage):
    # DeepSpeed's GatheredParameters keeps only the ZeRO parameters of what it is given, so a
    # block over [module.weight, module.bias] of a Linear without bias (bias None), or over None
    # alone, works (deepspeed/runtime/zero/partition_parameters.py). A TypeError before.
    config = mlp_config(stage)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4, bias=False), torch.nn.Tanh(),
                                torch.nn.Linear(4, 3))
    engine, _, _, _ = zinf.torch.initialize(model=model, config=config)
    first = engine.module[0]
    with zinf.torch.GatheredParameters(first.bias, modifier_rank=0):
        pass
    value = torch.arange(24, dtype=torch.float32).reshape(4, 6) / 10
    with zinf.torch.GatheredParameters([first.weight, first.bias], modifier_rank=0):
        first.weight.data.copy_(value)
    assert torch.equal(engine.read_parameter("0.weight"), value)


class _ModelWithMethods(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(6, 3)
        self.label = "the model's"
        self.stage = "the model's stage"

    def forward(self, x):
        return self.body(x)

    def predict(self, x):
        return self.forward(x).argmax(-1)


@pytest.mark.parametrize("stage", [1, 3])
def test_the_engine_passes_the_models_attributes_through(stage):
    # DeepSpeed's engine hands an attribute it does not define to the model (DeepSpeedEngine.
    # __getattr__): engine.generate(...), engine.save_pretrained(...), a submodule by name. An
    # AttributeError naming the engine before.
    torch.manual_seed(3)
    engine, _, _, _ = zinf.torch.initialize(model=_ModelWithMethods(), config=mlp_config(stage))
    x = mlp_batches(1)[0][0]
    assert engine.label == "the model's"
    assert engine.body is engine.module.body
    assert torch.equal(engine.predict(x), engine(x).argmax(-1))
    assert engine.stage == stage  # the engine's own attribute comes first
    with pytest.raises(AttributeError, match="'ZinfEngine' object has no attribute 'absent'"):
        engine.absent


def test_set_train_batch_size_changes_the_accumulation_and_keeps_the_micro_batch():
    # DeepSpeed's engine.set_train_batch_size(n) (deepspeed/runtime/engine.py): the steps'
    # gradient_accumulation_steps becomes n / (micro-batch x data-parallel ranks), the micro-batch
    # stays, and an n that is not a multiple raises ValueError ("Train batch size must be
    # divisible by micro-batch data parallelism"). zinf's engine had no such method (the
    # AttributeError came through the model).
    config = mlp_config(1)
    config["gradient_accumulation_steps"] = 4
    micro = config["train_micro_batch_size_per_gpu"]
    model, reference = make_mlp(), make_mlp()
    engine, _, _, _ = zinf.torch.initialize(model=model, config=config)
    assert engine.train_batch_size() == 4 * micro
    engine.set_train_batch_size(2 * micro)
    assert engine.gradient_accumulation_steps() == 2
    assert engine.train_batch_size() == 2 * micro
    assert engine.train_micro_batch_size_per_gpu() == micro
    batches = mlp_batches(4)
    for calls, batch in enumerate(batches):
        assert engine.is_gradient_accumulation_boundary() == (calls % 2 == 1)
        engine.backward(mlp_loss(engine, batch))
        engine.step()
    assert engine.global_steps == 2 and engine.global_samples == 4 * micro
    # torch's: two steps of two micro-batches, each loss counting 1/2, as DeepSpeed divides it.
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                  weight_decay=WEIGHT_DECAY)
    for first in (0, 2):
        for batch in batches[first:first + 2]:
            (mlp_loss(reference, batch) / 2).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
    for (name, got), expected in zip(model.named_parameters(), reference.parameters()):
        error = ((got.detach() - expected.detach()).norm() / expected.detach().norm()).item()
        assert error < 1e-5, f"{name}: relative error {error:.2e}"
    with pytest.raises(ValueError, match=r"^set_train_batch_size\(6\): train batch size must be "
                                         r"divisible by micro-batch data parallelism, .* = 4$"):
        engine.set_train_batch_size(6)
    # Above the config's count, which the engine fixed at initialize(): refused, naming the key.
    with pytest.raises(NotImplementedError, match=r"8 micro-batches per step, above the config's "
                                                  r"gradient_accumulation_steps \(4\)"):
        engine.set_train_batch_size(8 * micro)
    engine.set_train_batch_size(4 * micro)
    assert engine.gradient_accumulation_steps() == 4
    engine.backward(mlp_loss(engine, batches[0]))
    with pytest.raises(RuntimeError, match=r"holds 1 micro-batch\(es\) of a step not yet applied"):
        engine.set_train_batch_size(2 * micro)
    assert engine.gradient_accumulation_steps() == 4
    engine.destroy()


def test_the_client_lr_scheduler_and_wall_clock_breakdown_are_deepspeeds():
    # DeepSpeed's engine.client_lr_scheduler is initialize()'s lr_scheduler as given (a callable
    # stays the callable; engine.lr_scheduler is what it made), None without one.
    # wall_clock_breakdown() says whether the engine times its forward, backward and step: zinf's
    # keeps no such timers, so False whatever the config (whose key has no effect).
    from _helpers import ds_initialize

    config = mlp_config(1)
    config["wall_clock_breakdown"] = True

    def make(optimizer):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    engine, _, _, scheduler = zinf.torch.initialize(model=make_mlp(), config=config,
                                                    lr_scheduler=make)
    assert engine.client_lr_scheduler is make
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR)
    assert engine.lr_scheduler is scheduler
    assert engine.wall_clock_breakdown() is False
    engine.destroy()
    # deepspeed.initialize with the script's optimizer and a scheduler made over it.
    model = make_mlp()
    client = torch.optim.AdamW(model.parameters(), lr=LR)
    given = torch.optim.lr_scheduler.StepLR(client, step_size=1, gamma=0.5)
    config = mlp_config(1)
    del config["optimizer"]
    engine, _, _, scheduler = ds_initialize(model=model, config=config, optimizer=client,
                                            lr_scheduler=given)
    assert engine.client_lr_scheduler is given and scheduler is given
    engine.destroy()
    config = mlp_config(1)
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}
    engine, _, _, scheduler = zinf.torch.initialize(model=make_mlp(), config=config)
    assert engine.client_lr_scheduler is None
    assert isinstance(scheduler, zinf.torch.ConfigLRScheduler)
    engine.destroy()


@pytest.mark.parametrize("stage", [1, 3])
def test_a_static_loss_scale_skips_a_step_whose_gradients_are_not_finite(stage):
    # DeepSpeed checks fp16 gradients for inf and NaN and skips the step whatever the scale: its
    # engine gives the ZeRO stage 1 and 2 optimizer check_grad_overflow=True whenever fp16 is on
    # (_configure_zero_optimizer), its stage 3 optimizer checks for an fp16 dtype
    # (_overflow_check_and_loss_scale_update), and its stage-0 FP16_Optimizer checks too, logging
    # "Using static loss scale of ..." (fused_optimizer.py, _update_scale). A static scale only
    # stays where it is.
    config = mlp_config(stage)
    config["fp16"] = {"enabled": True, "loss_scale": 128}
    engine, optimizer, _, _ = zinf.torch.initialize(model=make_mlp(), config=config)
    assert engine.loss_scale == 128
    batches = [(x.half(), y.half()) for x, y in mlp_batches(2)]
    before = engine.read_parameter("0.weight")
    engine.backward(mlp_loss(engine, batches[0]).float() * float("inf"))
    engine.step()
    assert not engine.was_step_applied() and optimizer.overflow
    assert engine.global_steps == 1 and engine.skipped_steps == 1
    assert engine.loss_scale == 128
    assert torch.equal(engine.read_parameter("0.weight"), before)
    engine.backward(mlp_loss(engine, batches[1]).float())
    engine.step()
    assert engine.was_step_applied() and not optimizer.overflow
    assert engine.global_steps == 2 and engine.skipped_steps == 1
    assert engine.loss_scale == 128
    assert not torch.equal(engine.read_parameter("0.weight"), before)
    engine.destroy()
