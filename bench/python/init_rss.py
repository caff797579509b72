#!/usr/bin/env python3
"""The resident memory of a model built under zinf.torch.Init, with and without glibc's mmap
threshold fixed (MALLOC_MMAP_THRESHOLD_), in interleaved rounds.

    PYTHONPATH=<the built package> python bench/python/init_rss.py --dir <nvme dir> --rounds 3

The model is python/tests/init_model.Stack(width, layers) (defaults: 1024 x 64, a 271 MB fp32
model, docs/PYTHON.md's case), its weights drawn by its constructors from a fixed seed, trained
2 steps in bf16 at stage 3 with parameters, optimizer state and gradients on NVMe
(init_model.config). Each run is a child process of its own, so its RSS is its own; the rounds
alternate which variant runs first. A child first builds, initializes and trains a small model
(torch's and the engine's code paged in), then reads the RSS (VmRSS) as its baseline and resets
the peak (VmHWM, /proc/self/clear_refs), and reports, as growth over the baseline:
- build: the RSS after the model is built under Init, and the peak while building;
- initialize: the RSS after zinf.torch.initialize() (the engine's finalize), and the peak
  through it (reset before it);
- steps: the RSS after the 2 steps, and the peak through them (reset before them).
The parent prints the median of each figure over the rounds, per variant, and with --json writes
every run's figures.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..", "..", "python", "tests")
THRESHOLD = "131072"
FIGURES = ["build_rss", "build_peak", "initialize_rss", "initialize_peak", "steps_rss",
           "steps_peak"]


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


def child(directory, width, layers, seed):
    import torch
    sys.path.insert(0, TESTS)
    import zinf.torch
    from init_model import Stack, batch, config

    torch.set_num_threads(1)
    cfg = config(directory, width, bf16=True)
    small_cfg = config(directory, 16)
    with zinf.torch.Init(config=small_cfg):
        small = Stack(16, 2)
    engine, _, _, _ = zinf.torch.initialize(model=small, config=small_cfg)
    ids, labels = batch(0)
    engine.backward(engine(ids, labels))
    engine.step()
    engine.destroy()
    del engine, small
    before = status_bytes("VmRSS")
    reset_peak_rss()
    out = {}

    torch.manual_seed(seed)
    with zinf.torch.Init(config=cfg) as init:
        model = Stack(width, layers)
    out["build_rss"] = status_bytes("VmRSS") - before
    out["build_peak"] = status_bytes("VmHWM") - before
    reset_peak_rss()
    engine, _, _, _ = zinf.torch.initialize(model=model, config=cfg)
    out["initialize_rss"] = status_bytes("VmRSS") - before
    out["initialize_peak"] = status_bytes("VmHWM") - before
    reset_peak_rss()
    losses = []
    for step in range(2):
        ids, labels = batch(step)
        loss = engine(ids, labels)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    out["steps_rss"] = status_bytes("VmRSS") - before
    out["steps_peak"] = status_bytes("VmHWM") - before
    out.update(model_bytes=init.staged_bytes, baseline_rss=before, losses=losses,
               mmap_threshold=os.environ.get("MALLOC_MMAP_THRESHOLD_"))
    engine.destroy()
    print(json.dumps(out))


def run(args, variant, round_index):
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if variant == "threshold":
        env["MALLOC_MMAP_THRESHOLD_"] = THRESHOLD
    directory = os.path.join(args.dir, f"{variant}-{round_index}")
    os.makedirs(directory, exist_ok=True)
    try:
        result = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--child", "--dir", directory,
             "--width", str(args.width), "--layers", str(args.layers), "--seed", str(args.seed)],
            capture_output=True, text=True, env=env, timeout=args.timeout)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if result.returncode != 0:
        sys.exit(f"{variant} round {round_index} failed:\n{result.stdout[-3000:]}"
                 f"{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, help="the NVMe directory (a subdirectory a run)")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=3, help="torch.manual_seed of the model")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds a run")
    parser.add_argument("--json", help="write every run's figures here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.dir, args.width, args.layers, args.seed)
        return
    variants = ["default", "threshold"]
    runs = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            report = run(args, v, r)
            runs[v].append(report)
            print(f"round {r} {v}: " + ", ".join(f"{k} {report[k] / 1e6:.1f} MB" for k in FIGURES),
                  flush=True)
    model_mb = runs["default"][0]["model_bytes"] / 1e6
    print(f"\n{args.width} x {args.layers} (a {model_mb:.0f} MB fp32 model), growth over the "
          f"baseline RSS, median of {args.rounds} rounds, MB:")
    print(f"{'':32}" + "".join(f"{k:>17}" for k in FIGURES))
    for v in variants:
        name = "default" if v == "default" else f"MALLOC_MMAP_THRESHOLD_={THRESHOLD}"
        medians = [statistics.median(x[k] for x in runs[v]) / 1e6 for k in FIGURES]
        print(f"{name:32}" + "".join(f"{m:17.1f}" for m in medians))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
