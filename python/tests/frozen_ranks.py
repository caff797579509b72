"""Run by test_frozen.py under mpirun or torchrun (one process per rank): test_frozen's LoRA
model whose frozen base weights each rank draws with a seed of its own, trained at ZeRO stages 1
and 2 with each rank on its half of every batch, saved, and resumed into a model whose weights
(frozen and trainable) are drawn with other seeds again.

    mpirun -np 2 python frozen_ranks.py <out_dir> <stage> [<stage> ...]
    python -m torch.distributed.run --nproc_per_node 2 frozen_ranks.py <out_dir> <stage> ...
    mpirun -np 2 python frozen_ranks.py <out_dir> layout
    mpirun -np 2 python frozen_ranks.py <out_dir> buckets
    mpirun -np 2 python frozen_ranks.py <out_dir> layout <stage> ... buckets

Several modes (stages, layout, buckets) run one after another in one job, in the order given.

For each stage every rank writes <out_dir>/<stage>.rank<r>.pt: the frozen parameters as the rank
built them ("built") and as initialize() left them ("initialized"), the per-step losses of the
run ("losses", CHECKPOINT_STEP steps, the save, then the rest), the fp32 masters at its end
("masters"), and of the resumed run: its frozen parameters after initialize()
("resumed_initialized") and after load_checkpoint ("loaded"), and the losses of the steps after
the checkpoint ("resumed_losses").
layout: stage 2, rank 1's model with one frozen parameter fewer (a buffer in its place); every
rank writes initialize()'s error to <out_dir>/layout.rank<r>.json.
buckets: stage 2, the frozen parameters broadcast in buckets of BUCKET_BYTES, the first base
weight not contiguous; every rank writes <out_dir>/buckets.rank<r>.pt: the frozen parameters as
built and as initialize() left them, and the names each broadcast carried."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import zinf.torch  # noqa: E402
from test_frozen import STEPS, batches, config, loss_of, make  # noqa: E402

CHECKPOINT_STEP = 3
KIND = "lora"
# Less than the LoRA model's frozen bytes (fp32: base weights of 384 and 1024 bytes, biases of 64).
BUCKET_BYTES = 512


def make_with_frozen_seed(seed, frozen_seed):
    """test_frozen's LoRA model built with `seed`, its frozen weights drawn again with
    `frozen_seed` (as a model whose base weights each rank initialised differently)."""
    model = make(KIND, seed)
    generator = torch.Generator().manual_seed(frozen_seed)
    with torch.no_grad():
        for param in model.parameters():
            if not param.requires_grad:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model


def frozen_of(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


def shard(batch, rank, world):
    x, y = batch
    per = x.shape[0] // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def train(engine, data):
    losses = []
    for batch in data:
        loss = loss_of(engine, shard(batch, engine.global_rank, engine.world_size))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def run(out_dir, stage, rank):
    data = batches(KIND, STEPS)
    model = make_with_frozen_seed(21, 100 + rank)
    built = frozen_of(model)
    engine, _, _, _ = zinf.torch.initialize(model=model, config=config(stage),
                                            model_parameters=model.parameters())
    initialized = frozen_of(model)
    losses = train(engine, data[:CHECKPOINT_STEP])
    checkpoint = os.path.join(out_dir, f"{stage}.ckpt")
    engine.save_checkpoint(checkpoint)
    losses += train(engine, data[CHECKPOINT_STEP:])
    masters = {name: engine.read_parameter(name) for name, _ in model.named_parameters()}
    engine.destroy()

    # Resumed into a model of other seeds, the frozen weights again different on each rank.
    model = make_with_frozen_seed(99, 200 + rank)
    resumed, _, _, _ = zinf.torch.initialize(model=model, config=config(stage),
                                             model_parameters=model.parameters())
    resumed_initialized = frozen_of(model)
    resumed.load_checkpoint(checkpoint)
    loaded = frozen_of(model)
    resumed_losses = train(resumed, data[CHECKPOINT_STEP:])
    resumed.destroy()
    torch.save({"world_size": engine.world_size, "built": built, "initialized": initialized,
                "losses": losses, "masters": masters, "resumed_initialized": resumed_initialized,
                "loaded": loaded, "resumed_losses": resumed_losses},
               os.path.join(out_dir, f"{stage}.rank{rank}.pt"))


def layout(out_dir, rank):
    model = make(KIND)
    if rank == 1:
        del model.second.base.bias
        model.second.base.register_buffer("bias", torch.zeros(16), persistent=False)
    try:
        zinf.torch.initialize(model=model, config=config(2), model_parameters=model.parameters())
        error = None
    except ValueError as e:
        error = str(e)
    with open(os.path.join(out_dir, f"layout.rank{rank}.json"), "w") as f:
        json.dump({"error": error}, f)


def buckets(out_dir, rank):
    model = make_with_frozen_seed(21, 100 + rank)
    weight = model.first.base.weight
    weight.data = weight.data.t().contiguous().t()  # the same values over a transposed layout
    built = frozen_of(model)
    carried = []
    broadcast_bucket = zinf.torch.ZinfEngine._broadcast_bucket

    def counted(engine, bucket, bucket_bytes):
        carried.append([name for name, _ in bucket])
        return broadcast_bucket(engine, bucket, bucket_bytes)

    bucket_bytes = zinf.torch._FROZEN_BUCKET_BYTES
    zinf.torch.ZinfEngine._broadcast_bucket = counted
    zinf.torch._FROZEN_BUCKET_BYTES = BUCKET_BYTES
    try:
        engine, _, _, _ = zinf.torch.initialize(model=model, config=config(2),
                                                model_parameters=model.parameters())
    finally:
        zinf.torch.ZinfEngine._broadcast_bucket = broadcast_bucket
        zinf.torch._FROZEN_BUCKET_BYTES = bucket_bytes
    torch.save({"built": built, "initialized": frozen_of(model), "carried": carried,
                "contiguous": model.first.base.weight.is_contiguous()},
               os.path.join(out_dir, f"buckets.rank{rank}.pt"))
    engine.destroy()


if __name__ == "__main__":
    torch.set_num_threads(1)
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0")))
    for mode in sys.argv[2:]:
        if mode == "layout":
            layout(sys.argv[1], rank)
        elif mode == "buckets":
            buckets(sys.argv[1], rank)
        else:
            run(sys.argv[1], int(mode), rank)
