#!/usr/bin/env python3
"""zinf.torch beside DeepSpeed ZeRO-3 on one machine: the same model, the same config (stage 3,
bf16, optimizer state and parameters on NVMe), the same batches, in interleaved rounds.

    bench/python/deepspeed_side_by_side.sh --models example,250m --rounds 3

(the shell wrapper makes build/venv-ds with DeepSpeed over the test venv, and runs this with it).

Each run is a child process of its own (`--child`), so its peak RSS and its I/O are its own:
- step time: the wall time of one whole training step (forward, engine.backward, engine.step),
  the median over the timed steps after `--warmup` untimed ones;
- peak RSS: VmHWM of the child, reset (/proc/self/clear_refs) after initialize(), so it is the
  peak while training, with the model built and handed over; the whole process's peak (model
  construction included) is reported beside it;
- bytes to and from NVMe per step: read_bytes / write_bytes of /proc/self/io (bytes the process,
  its threads and its io_uring workers asked the block layer for; both engines use O_DIRECT, so
  every byte of their swap files is counted there and nothing else moves during the steps),
  averaged over the timed steps. For zinf the engine's own counters (the step report's optimizer
  bytes, and the parameter shard reads and writes) are reported beside them as a cross-check.
The rounds alternate which side runs first. The parent prints a table and, with --json, writes
every run's figures.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

# The models: the example's GPT-2 (examples/torch_gpt, as train.py runs it) and a GPT-2 of about
# 250M parameters (20 blocks of 1024; bytes as tokens, so the embeddings are small).
MODELS = {
    "example": dict(layers=2, width=64, heads=4, context=64, batch=8, sequence=64, lr=3e-3,
                    persistence=0, steps=6, warmup=2),
    "250m": dict(layers=20, width=1024, heads=16, context=128, batch=2, sequence=64, lr=3e-4,
                 persistence=100000, steps=3, warmup=1),
}


def make_config(spec: dict, nvme_path: str, sub_group_size: int) -> dict:
    """One config for both engines, in DeepSpeed's keys (every key both read)."""
    return {
        "train_micro_batch_size_per_gpu": spec["batch"],
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW",
                      "params": {"lr": spec["lr"], "betas": [0.9, 0.999], "eps": 1e-8,
                                 "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 4},
            # DeepSpeed pins buffer_count x buffer_size elements for parameters (1e8 by
            # default); 1e7 holds the largest parameter of either model. zinf sizes its staging
            # blocks to the largest shard whatever buffer_size says.
            # max_in_cpu: DeepSpeed keeps up to this many parameter elements in host memory
            # instead of on NVMe (1e9 by default, so every parameter of these models); 0 puts
            # them all on NVMe, as zinf does (for which the key has no effect).
            "offload_param": {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 5,
                              "buffer_size": 10_000_000, "max_in_cpu": 0},
            "sub_group_size": sub_group_size,
            "reduce_bucket_size": 10_000_000,
            "stage3_prefetch_bucket_size": 10_000_000,
            "stage3_max_live_parameters": 30_000_000,
            "stage3_param_persistence_threshold": spec["persistence"],
        },
        "aio": {"block_size": 1048576, "queue_depth": 32},
    }


def proc_io() -> tuple[int, int]:
    fields = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, value = line.split(":")
            fields[key] = int(value)
    return fields["read_bytes"], fields["write_bytes"]


def vm_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child(args) -> dict:
    """One run: builds the model, hands it to one engine, trains, returns its figures."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "examples", "torch_gpt"))
    import gpt

    spec = MODELS[args.model]
    torch.manual_seed(0)
    model = gpt.make_model(seed=1, layers=spec["layers"], width=spec["width"],
                           heads=spec["heads"], context=spec["context"])
    param_count = sum(p.numel() for p in model.parameters())
    config = make_config(spec, args.nvme_path, args.sub_group_size)
    data = gpt.batches(gpt.read_text(), spec["batch"], spec["sequence"], seed=2)
    steps = args.steps or spec["steps"]
    warmup = spec["warmup"] if args.warmup is None else args.warmup
    batches = [next(data) for _ in range(warmup + steps)]

    start = time.perf_counter()
    if args.side == "zinf":
        import zinf.torch

        engine, _, _, _ = zinf.torch.initialize(model=model, config=config,
                                                model_parameters=model.parameters())
    else:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                               model_parameters=model.parameters())
    init_s = time.perf_counter() - start
    whole_peak_kb = vm_kb("VmHWM")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS

    def counters():
        if args.side != "zinf":
            return {}
        c = engine.counters()
        return {"param_read": c["param_nvme_read_bytes"], "param_write": c["param_nvme_write_bytes"]}

    losses, times_s, reads, writes, zinf_reads, zinf_writes = [], [], [], [], [], []
    for index, (ids, labels) in enumerate(batches):
        io0, c0, t0 = proc_io(), counters(), time.perf_counter()
        loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        engine.step()
        t1, io1, c1 = time.perf_counter(), proc_io(), counters()
        losses.append(float(loss.float().item()))
        if index < warmup:
            continue
        times_s.append(t1 - t0)
        reads.append(io1[0] - io0[0])
        writes.append(io1[1] - io0[1])
        if args.side == "zinf":
            report = engine.last_step_report
            zinf_reads.append(c1["param_read"] - c0["param_read"]
                              + report["optimizer_nvme_read_bytes"])
            zinf_writes.append(c1["param_write"] - c0["param_write"]
                               + report["optimizer_nvme_write_bytes"])
    swap_bytes = 0
    for dirpath, _, files in os.walk(args.nvme_path):
        for name in files:
            try:
                swap_bytes += os.stat(os.path.join(dirpath, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    result = {
        "side": args.side, "model": args.model, "param_count": param_count,
        "init_s": init_s, "step_s": times_s, "step_s_median": statistics.median(times_s),
        "losses": losses, "peak_rss_bytes": vm_kb("VmHWM") * 1024,
        "whole_peak_rss_bytes": max(whole_peak_kb, vm_kb("VmHWM")) * 1024,
        "nvme_read_bytes_per_step": statistics.mean(reads),
        "nvme_write_bytes_per_step": statistics.mean(writes),
        "swap_bytes": swap_bytes,
    }
    if zinf_reads:
        result["zinf_counted_read_bytes_per_step"] = statistics.mean(zinf_reads)
        result["zinf_counted_write_bytes_per_step"] = statistics.mean(zinf_writes)
    if args.side == "zinf":
        engine.destroy()  # closes the engine (its swap files) before the parent deletes them
    return result


def run_child(side: str, model: str, args, tag: str) -> dict:
    nvme_path = os.path.join(args.scratch, f"{side}-{model}-{tag}")
    shutil.rmtree(nvme_path, ignore_errors=True)
    os.makedirs(nvme_path)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--side", side, "--model", model,
           "--nvme-path", nvme_path, "--sub-group-size", str(args.sub_group_size)]
    if args.steps:
        cmd += ["--steps", str(args.steps)]
    if args.warmup is not None:
        cmd += ["--warmup", str(args.warmup)]
    # The same allocator settings for both: glibc returns large freed blocks to the system.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    env.pop("WORLD_SIZE", None)
    try:
        out = subprocess.run(cmd, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
    finally:
        shutil.rmtree(nvme_path, ignore_errors=True)
    return json.loads(out.strip().splitlines()[-1])


def load_average() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def gb(value: float) -> str:
    return f"{value / 1e9:.3f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="example,250m", help="comma-separated: example, 250m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=0, help="timed steps (default per model)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first")
    parser.add_argument("--sub-group-size", type=int, default=10_000_000)
    parser.add_argument("--scratch", default="/tmp/zinf-ds-bench",
                        help="the NVMe directory; each run's swap files are deleted after it")
    parser.add_argument("--json", default=None, help="write every run's figures here")
    parser.add_argument("--no-warm-up", action="store_true",
                        help="skip the untimed first run (DeepSpeed's ops are built already)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--side", choices=["zinf", "deepspeed"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--nvme-path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return

    models = args.models.split(",")
    for model in models:
        if model not in MODELS:
            parser.error(f"--models: unknown model '{model}' ({', '.join(MODELS)})")
    os.makedirs(args.scratch, exist_ok=True)
    # DeepSpeed compiles its CPU Adam and async_io ops on first use: an untimed run first.
    if not args.no_warm_up:
        print("warm-up run of each side (DeepSpeed JIT-builds its ops)", flush=True)
        for side in ("deepspeed", "zinf"):
            run_child(side, "example",
                      argparse.Namespace(**{**vars(args), "steps": 1, "warmup": 0}), "warm")
    runs = []
    for round_index in range(args.rounds):
        order = ("zinf", "deepspeed") if round_index % 2 == 0 else ("deepspeed", "zinf")
        for model in models:
            for side in order:
                load = load_average()
                result = run_child(side, model, args, f"r{round_index}")
                result.update(round=round_index + 1, load_before=load, load_after=load_average())
                runs.append(result)
                print(f"round {round_index + 1} {model:8s} {side:9s} "
                      f"step {result['step_s_median']:.3f} s  "
                      f"peak RSS {gb(result['peak_rss_bytes'])} GB "
                      f"(whole {gb(result['whole_peak_rss_bytes'])})  "
                      f"NVMe/step read {gb(result['nvme_read_bytes_per_step'])} GB "
                      f"write {gb(result['nvme_write_bytes_per_step'])} GB  "
                      f"losses {result['losses'][0]:.4f}..{result['losses'][-1]:.4f}  "
                      f"load {load}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)

    print("\nmodel | params | zinf step s | DeepSpeed step s | time ratio DS/zinf | zinf peak RSS"
          " GB | DS peak RSS GB | RSS ratio DS/zinf | zinf NVMe GB/step r+w | DS NVMe GB/step r+w")
    for model in models:
        by_round = {}
        for r in runs:
            if r["model"] == model:
                by_round.setdefault(r["round"], {})[r["side"]] = r
        pairs = [v for v in by_round.values() if len(v) == 2]
        med = lambda side, key: statistics.median(p[side][key] for p in pairs)
        time_ratio = statistics.median(p["deepspeed"]["step_s_median"] / p["zinf"]["step_s_median"]
                                       for p in pairs)
        rss_ratio = statistics.median(p["deepspeed"]["peak_rss_bytes"] / p["zinf"]["peak_rss_bytes"]
                                      for p in pairs)
        print(f"{model} | {pairs[0]['zinf']['param_count']:,} | {med('zinf', 'step_s_median'):.3f}"
              f" | {med('deepspeed', 'step_s_median'):.3f} | {time_ratio:.2f} | "
              f"{gb(med('zinf', 'peak_rss_bytes'))} | {gb(med('deepspeed', 'peak_rss_bytes'))} | "
              f"{rss_ratio:.2f} | {gb(med('zinf', 'nvme_read_bytes_per_step'))} + "
              f"{gb(med('zinf', 'nvme_write_bytes_per_step'))} | "
              f"{gb(med('deepspeed', 'nvme_read_bytes_per_step'))} + "
              f"{gb(med('deepspeed', 'nvme_write_bytes_per_step'))}")


if __name__ == "__main__":
    main()
