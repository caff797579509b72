#!/usr/bin/env python3
"""Trains a small GPT-2 (transformers, random init, bytes as tokens) on the King James
Pentateuch with zinf: ZeRO stage 1, 2 or 3, optimizer state and parameters offloaded to host
memory or NVMe.

    python examples/torch_gpt/train.py --stage 3 --offload nvme --nvme-path /tmp/zinf-swap

The training loop is DeepSpeed's: initialize, engine(batch), engine.backward(loss), engine.step().
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt  # noqa: E402
import zinf.torch  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--stage", type=int, default=3, choices=[1, 2, 3])
    parser.add_argument("--offload", default="none", choices=["none", "cpu", "nvme"],
                        help="where the optimizer state lives (offload_optimizer.device)")
    parser.add_argument("--offload-param", default="none", choices=["none", "cpu", "nvme"],
                        help="where stage 3 keeps the parameter shards (offload_param.device)")
    parser.add_argument("--nvme-path", default=None,
                        help="swap directory for nvme offload (default: a temporary one, removed "
                             "at the end)")
    parser.add_argument("--bf16", action="store_true", help="compute in bf16, fp32 master")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--sequence", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--save", default=None, help="checkpoint directory written at the end")
    parser.add_argument("--load", default=None, help="checkpoint directory to resume from")
    args = parser.parse_args()

    # A temporary swap directory only where NVMe offload needs one and none was given; it is
    # removed at the end, once the engine has closed its swap files.
    uses_nvme = "nvme" in (args.offload, args.offload_param)
    temporary = None
    if uses_nvme and args.nvme_path is None:
        temporary = tempfile.mkdtemp(prefix="zinf-swap-")
    try:
        train(args, args.nvme_path or temporary or "")
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)


def train(args, nvme_path):
    model = gpt.make_model(seed=1, layers=args.layers, width=args.width, context=args.sequence)
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": args.bf16},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": args.stage,
            "offload_optimizer": {"device": args.offload, "nvme_path": nvme_path},
            "offload_param": {"device": args.offload_param, "nvme_path": nvme_path},
            "stage3_param_persistence_threshold": 0,
        },
    }
    engine, _, _, _ = zinf.torch.initialize(model=model, config=config,
                                            model_parameters=model.parameters())
    if args.load:
        engine.load_checkpoint(args.load)
    # Under mpirun (one process per rank, MpiComm) each rank draws its own batches.
    data = gpt.batches(gpt.read_text(), args.batch, args.sequence,
                       seed=2 + engine.global_steps + 1000 * engine.global_rank)
    start = time.perf_counter()
    for step in range(args.steps):
        ids, labels = next(data)
        loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        engine.step()
        if engine.global_rank == 0 and (step % 20 == 0 or step == args.steps - 1):
            print(f"step {engine.global_steps:5d}  loss {loss.item():.4f}  "
                  f"{(time.perf_counter() - start) / (step + 1) * 1e3:.1f} ms/step", flush=True)
    if args.save:
        engine.save_checkpoint(args.save)
        print(f"checkpoint: {args.save}")
    engine.destroy()


if __name__ == "__main__":
    main()
