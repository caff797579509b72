"""What a DeepSpeed training script calls, ported by changing its import: the engine's accessors
(the stage, the dtypes, whether a step was applied, the skipped steps, the samples, the gradient
norm, the accumulation boundary), a torch scheduler across an fp16 overflow, the training data
loader, `args.deepspeed_config`, load_checkpoint's options, the zero_to_fp32 functions and
save_16bit_model. Each expected value is DeepSpeed's (deepspeed/runtime/engine.py and
dataloader.py, deepspeed/utils/zero_to_fp32.py), written out in the test."""
import argparse
import json

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

import zinf.torch
from conftest import make_batches, make_mlp, make_model, mlp_batches, mlp_config, mlp_loss


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
        if boundary:
            assert engine.get_global_grad_norm() == engine.last_step_report["grad_norm"]
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
                   {"load_lr_scheduler_states": False}, {"load_module_strict": False},
                   {"custom_load_fn": print}]:
        with pytest.raises(NotImplementedError,
                           match=f"{next(iter(option))}.*export_safetensors.*GatheredParameters"):
            engine.load_checkpoint(str(tmp_path), **option)
    path, client = engine.load_checkpoint(str(tmp_path), load_module_strict=True,
                                          load_optimizer_states=True,
                                          load_lr_scheduler_states=True, load_module_only=False)
    assert path == str(tmp_path / "global_step2") and client == {}


def test_the_engine_reports_where_and_how_it_runs():
    config = mlp_config(1)
    config["steps_per_print"] = 25
    engine, _, _, _ = zinf.torch.initialize(model=make_mlp(), config=config)
    x, y = mlp_batches(1)[0]
    assert engine(x.to(engine.device)).shape == y.shape
    assert engine.dp_world_size == engine.world_size == 1
    assert engine.steps_per_print() == 25
    assert engine.zero_optimization_stage() == 1 and engine.zero_optimization()
    assert not engine.fp16_enabled() and not engine.bfloat16_enabled()


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


def test_save_16bit_model_writes_the_whole_state_dict(tmp_path):
    config = mlp_config(3)
    config["bf16"] = {"enabled": True}
    engine, _, _, _ = zinf.torch.initialize(model=make_model(), config=config)
    for ids, labels in make_batches(1):
        engine.backward(engine(input_ids=ids, labels=labels).loss)
        engine.step()
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
