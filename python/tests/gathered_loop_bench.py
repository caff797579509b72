"""Times a loop of single-parameter GatheredParameters blocks over a model of N tiny parameters
(each its own module, as a loop that reads one parameter at a time after initialize(), such as
DeepSpeed-Chat's save_zero_three_model, makes), for each N given: the time per block should not
grow with N. Blocks that change a parameter are not timed: each costs a pass over the rank's
master partition (docs/PYTHON.md).

    python python/tests/gathered_loop_bench.py [N ...]            (default 1000 4000)
    mpirun -np 2 python python/tests/gathered_loop_bench.py [N ...]

Each N runs stage 3 twice: blocks that read (no modifier_rank) and blocks with modifier_rank=0
that change nothing (with several ranks every rank's block end then takes part in the root's
broadcast of what it changed). Prints one line per N and kind: the loop's seconds, and its
ratio to the first N's. Not a test: the numbers depend on the machine."""
import sys
import time

import torch
from torch import nn

import zinf.torch


def make(parameter_count: int) -> nn.Module:
    generator = torch.Generator().manual_seed(parameter_count)
    model = nn.ModuleList(nn.Linear(2, 2, bias=False) for _ in range(parameter_count))
    with torch.no_grad():
        for layer in model:
            layer.weight.copy_(torch.randn(2, 2, generator=generator))
    return model


def config():
    return {"train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "zinf": {"cpu_threads": 1}}


def time_blocks(engine, model, modifier_rank) -> float:
    params = [layer.weight for layer in model]
    started = time.perf_counter()
    for param in params:
        with zinf.torch.GatheredParameters(param, modifier_rank=modifier_rank):
            pass
    return time.perf_counter() - started


def main(counts):
    torch.set_num_threads(1)
    first = {}
    for count in counts:
        model = make(count)
        engine, _, _, _ = zinf.torch.initialize(model=model, config=config(),
                                                model_parameters=model.parameters())
        try:
            for kind, modifier_rank in (("read", None), ("modifier_rank=0", 0)):
                seconds = time_blocks(engine, model, modifier_rank)
                first.setdefault(kind, (count, seconds))
                base_count, base_seconds = first[kind]
                if engine.global_rank == 0:
                    print(f"N={count:6d} {kind:16s} {seconds:8.3f} s  {seconds / count * 1e6:8.1f}"
                          f" us/block  x{seconds / base_seconds:5.2f} of N={base_count}"
                          f" (linear: x{count / base_count:.2f})", flush=True)
        finally:
            engine.destroy()


if __name__ == "__main__":
    main([int(arg) for arg in sys.argv[1:]] or [1000, 4000])
