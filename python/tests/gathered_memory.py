"""The host memory and time of GatheredParameters over a whole stage-3 model: builds
init_model.Stack(width, layers) under zinf.torch.Init, initializes a stage-3 engine with the
parameters in host memory (fp32), trains one step, then runs one of these blocks, after
resetting the process's peak RSS (/proc/self/status VmHWM):

  read:       GatheredParameters(model.parameters()), reading every parameter's sum
  keep:       the same, keeping p.data.cpu() of every parameter (DeepSpeed-Chat's
              save_zero_three_model), the kept tensors dropped after the measurement
  write_none: GatheredParameters(model.parameters(), modifier_rank=0), changing nothing
  write_one:  the same, changing one layer's bias
  write_all:  the same, halving every parameter (a whole-model write)

and prints one JSON line: the model's fp32 bytes, its bytes in the dtype it computes in (what a
gather holds), the peak RSS growth over the RSS before the block, the RSS growth left after it
(what the engine keeps), the block's seconds (entry to exit), and whether the values are right.
With bf16 after the scenario the model computes in bf16 (the config's bf16 section).

    python gathered_memory.py <dir> <width> <layers> read|keep|write_none|write_one|write_all
        [bf16]
    mpirun -np 2 python gathered_memory.py ...   (each rank prints its line, with its rank)"""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import zinf.torch  # noqa: E402
from init_memory import reset_peak_rss, status_bytes  # noqa: E402
from init_model import Stack, batch, config  # noqa: E402


def measure(run):
    reset_peak_rss()
    before = status_bytes("VmRSS")
    started = time.perf_counter()
    result = run()
    seconds = time.perf_counter() - started
    return {"peak_growth_bytes": status_bytes("VmHWM") - before,
            "after_growth_bytes": status_bytes("VmRSS") - before, "seconds": round(seconds, 3),
            **(result or {})}


def main():
    directory, width, layers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    scenario = sys.argv[4]
    bf16 = "bf16" in sys.argv[5:]
    torch.set_num_threads(1)
    cfg = config(directory, width, offload="none", stage3_max_live_parameters=10**10)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    cfg["zinf"]["gradients_on_nvme"] = False
    if bf16:
        cfg["bf16"] = {"enabled": True}
    torch.manual_seed(3)
    with zinf.torch.Init(config=cfg):
        model = Stack(width, layers)
    engine, _, _, _ = zinf.torch.initialize(model=model, config=cfg)
    ids, labels = batch(0)
    engine.backward(engine(ids, labels))
    engine.step()
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    model_bytes = sum(p.ds_numel for p in params) * 4
    gathered_bytes = model_bytes // 2 if bf16 else model_bytes
    # write_all halves every parameter as the block sees it: in the compute dtype.
    dtype = torch.bfloat16 if bf16 else torch.float32
    halved = ({n: (engine.read_parameter(n).to(dtype) * 0.5).float() for n in names}
              if scenario == "write_all" else {})

    def read():
        with zinf.torch.GatheredParameters(params):
            total = sum(p.sum().item() for p in params)
        return {"sum": total}

    kept = []

    def keep():
        with zinf.torch.GatheredParameters(params):
            kept.extend(p.data.cpu() for p in params)

    def write(change):
        def run():
            with zinf.torch.GatheredParameters(params, modifier_rank=0):
                if change == "one":
                    model.layers[0].bias.data.fill_(0.5)
                elif change == "all":
                    for p in params:
                        p.data.mul_(0.5)
        return run

    runs = {"read": read, "keep": keep, "write_none": write(None), "write_one": write("one"),
            "write_all": write("all")}
    report = {"scenario": scenario, "rank": engine.global_rank, "model_bytes": model_bytes,
              "gathered_bytes": gathered_bytes, **measure(runs[scenario])}
    if scenario == "keep":
        report["right"] = all(torch.equal(t, engine.read_parameter(n))
                              for t, n in zip(kept, names))
    elif scenario == "write_all":
        report["right"] = all(torch.equal(engine.read_parameter(n), halved[n]) for n in names)
    elif scenario.startswith("write"):
        report["right"] = torch.equal(engine.read_parameter("layers.0.bias"),
                                      torch.full((width,), 0.5)) == (scenario == "write_one")
    engine.destroy()
    # One write per line: the ranks' lines reach mpirun's output whole.
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
