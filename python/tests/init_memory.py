"""Run by test_init.py in a child process: builds init_model.Stack(width, layers) under
zinf.torch.Init, trains it 2 steps at stage 3 with parameters, optimizer state and gradients on
NVMe (in <dir>), and prints one JSON line: the model's fp32 bytes, the RSS before building it
and its peak since (/proc/self/status, the peak reset first), the process's whole peak RSS
(getrusage), the losses, and the engine's live-parameter peak and limit.

    python init_memory.py <dir> <width> <layers> [bf16]"""
import json
import os
import resource
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import zinf.torch  # noqa: E402
from init_model import Stack, batch, config  # noqa: E402


def status_bytes(key):
    """VmRSS (the resident set now) or VmHWM (its peak) from /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak_rss():
    """Sets the peak (VmHWM) to the RSS now (Linux: 5 to /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main():
    directory, width, layers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    bf16 = len(sys.argv) > 4 and sys.argv[4] == "bf16"
    cfg = config(directory, width, bf16=bf16)
    # torch's kernels, autograd and the engine's code touched once on a small model, so that
    # the baseline holds the libraries' pages rather than the model's.
    with zinf.torch.Init(config=config(directory, 16)):
        small = Stack(16, 2)
    engine, _, _, _ = zinf.torch.initialize(model=small, config=config(directory, 16))
    ids, labels = batch(0)
    engine.backward(engine(ids, labels))
    engine.step()
    engine.destroy()
    del engine, small
    reset_peak_rss()
    before = status_bytes("VmRSS")

    torch.manual_seed(3)
    with zinf.torch.Init(config=cfg) as init:
        model = Stack(width, layers)
    after_build = status_bytes("VmHWM")
    engine, _, _, _ = zinf.torch.initialize(model=model, config=cfg)
    losses = []
    for step in range(2):
        ids, labels = batch(step)
        loss = engine(ids, labels)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    end = status_bytes("VmHWM")
    process_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    counters = engine.counters()
    print(json.dumps({
        "model_bytes": init.staged_bytes,
        "rss_before_bytes": before,
        "rss_after_build_bytes": after_build,
        "rss_peak_since_before_bytes": end,
        "rss_growth_bytes": end - before,
        "rss_peak_bytes": process_peak,
        "losses": losses,
        "live_peak": counters["live_elements_peak"],
        "max_live": cfg["zero_optimization"]["stage3_max_live_parameters"],
        "memory": engine.memory(),
        "param_nvme_read_bytes": counters["param_nvme_read_bytes"],
    }))


if __name__ == "__main__":
    main()
