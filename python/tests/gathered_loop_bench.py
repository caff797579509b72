"""Times a loop of single-parameter GatheredParameters blocks over a model of N tiny parameters
(each its own module, as a loop that reads one parameter at a time after initialize(), such as
DeepSpeed-Chat's save_zero_three_model, makes), for each N given: the time per block should not
grow with N.

    python python/tests/gathered_loop_bench.py [write] [N ...]            (default 1000 4000)
    mpirun -np 2 python python/tests/gathered_loop_bench.py [write] [N ...]

Each N runs stage 3 twice: blocks that read (no modifier_rank) and blocks with modifier_rank=0
that change nothing (with several ranks every rank's block end then takes part in the root's
broadcast of what it changed). With `write`, each N runs stage 2 instead: blocks that read, and
blocks with modifier_rank=0 that change their parameter (each a write of the parameter's group,
Engine::write_parameters; every module is a group of its own), whose values are checked against
the engine's afterwards. Prints one line per N and kind: the loop's seconds, and its ratio to the
first N's. Not a test: the numbers depend on the machine."""
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


def config(stage: int):
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {"train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": zero, "zinf": {"cpu_threads": 1}}


def time_blocks(engine, model, modifier_rank, write: bool = False) -> float:
    params = [layer.weight for layer in model]
    started = time.perf_counter()
    for index, param in enumerate(params):
        with zinf.torch.GatheredParameters(param, modifier_rank=modifier_rank):
            if write:
                param.data.fill_(float(index))
    seconds = time.perf_counter() - started
    if write:
        for index, layer in enumerate(model):
            expected = torch.full((2, 2), float(index))
            assert torch.equal(layer.weight.detach(), expected), index
            assert torch.equal(engine.read_parameter(f"{index}.weight"), expected), index
    return seconds


def main(counts, write: bool):
    torch.set_num_threads(1)
    first = {}
    kinds = ((("read", None, False), ("write", 0, True)) if write
             else (("read", None, False), ("modifier_rank=0", 0, False)))
    for count in counts:
        model = make(count)
        engine, _, _, _ = zinf.torch.initialize(model=model, config=config(2 if write else 3),
                                                model_parameters=model.parameters())
        try:
            for kind, modifier_rank, writes in kinds:
                seconds = time_blocks(engine, model, modifier_rank, writes)
                first.setdefault(kind, (count, seconds))
                base_count, base_seconds = first[kind]
                if engine.global_rank == 0:
                    print(f"N={count:6d} {kind:16s} {seconds:8.3f} s  {seconds / count * 1e6:8.1f}"
                          f" us/block  x{seconds / base_seconds:5.2f} of N={base_count}"
                          f" (linear: x{count / base_count:.2f})", flush=True)
        finally:
            engine.destroy()


if __name__ == "__main__":
    args = sys.argv[1:]
    write = bool(args) and args[0] == "write"
    main([int(arg) for arg in args[write:]] or [1000, 4000], write)
