"""DeepSpeed-Chat's save_zero_three_model, unchanged, over zinf.deepspeed_compat: a model built
under deepspeed.zero.Init, trained two steps at ZeRO-3, saved parameter by parameter through
GatheredParameters where `ds_status` says a parameter is not available. Writes
<out>/save.rank<r>.json: per parameter, the largest difference between the saved tensor and the
engine's fp32 master (engine.read_parameter), and what the attributes showed.

    python zero3_save_run.py OUT            (one process)
    mpirun -np 2 python zero3_save_run.py OUT

test_zero3_params.py runs it in one process, and calls main() in a job of 2 ranks under mpirun
that first runs another check (before any initialize() of the process).
"""
import json
import os
import sys

import zinf.deepspeed_compat

zinf.deepspeed_compat.install()

import deepspeed  # noqa: E402
import torch  # noqa: E402

from init_model import Stack, batch  # noqa: E402


def _z3_params_to_fetch(param_list):
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    return [p for p in param_list
            if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def save_zero_three_model(model_ema, global_rank, save_dir, zero_stage=0):
    zero_stage_3 = (zero_stage == 3)
    os.makedirs(save_dir, exist_ok=True)
    output_model_file = os.path.join(save_dir, "pytorch_model.bin")
    model_to_save = model_ema.module if hasattr(model_ema, "module") else model_ema
    if not zero_stage_3:
        if global_rank == 0:
            torch.save(model_to_save.state_dict(), output_model_file)
    else:
        output_state_dict = {}
        for k, v in model_to_save.named_parameters():
            if hasattr(v, "ds_id"):
                with deepspeed.zero.GatheredParameters(_z3_params_to_fetch([v]),
                                                       enabled=zero_stage_3):
                    v_p = v.data.cpu()
            else:
                v_p = v.cpu()
            if global_rank == 0 and "lora" not in k:
                output_state_dict[k] = v_p
        if global_rank == 0:
            torch.save(output_state_dict, output_model_file)
        del output_state_dict


def main(out):
    width = 32
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_max_live_parameters": 2000}}
    torch.manual_seed(3)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = Stack(width, 2)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)
    rank = engine.global_rank
    for step in range(2):
        ids, labels = batch(10 * step + rank)
        loss = engine(ids, labels)
        engine.backward(loss)
        engine.step()
    save_dir = os.path.join(out, "saved")
    save_zero_three_model(engine, rank, save_dir, zero_stage=3)
    params = dict(engine.module.named_parameters())
    report = {"ids": [p.ds_id for p in params.values()],
              "status": [p.ds_status.name for p in params.values()],
              "shapes": [list(p.ds_shape) for p in params.values()],
              "numels": [p.ds_numel for p in params.values()]}
    with deepspeed.zero.GatheredParameters([params["head.weight"]]):
        report["status_gathered"] = params["head.weight"].ds_status.name
    masters = {name: engine.read_parameter(name) for name in params}
    if rank == 0:
        saved = torch.load(os.path.join(save_dir, "pytorch_model.bin"))
        report["saved"] = sorted(saved)
        report["diff"] = {name: (saved[name].float() - master).abs().max().item()
                          for name, master in masters.items()}
        # The masters moved from the constructors' values (the save is of trained values).
        torch.manual_seed(3)
        initial = dict(Stack(width, 2).named_parameters())
        report["moved"] = {name: (master - initial[name]).abs().max().item()
                           for name, master in masters.items()}
    with open(os.path.join(out, f"save.rank{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
