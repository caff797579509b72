"""Run by torchrun from test_torchrun.py (one process per rank, zinf.torch on its "torch"
communicator): the modes of mp_train.py, which do not depend on the launcher, and a checkpoint.

    python -m torch.distributed.run --nproc_per_node 2 torchrun_train.py oracle <out_dir> <case>...
    python -m torch.distributed.run --nproc_per_node 2 torchrun_train.py fail <out_dir> <ms> <where>
    python -m torch.distributed.run --nproc_per_node 2 torchrun_train.py checkpoint <out_dir>
    python -m torch.distributed.run --nproc_per_node 2 torchrun_train.py dist_first <out_dir>
    python -m torch.distributed.run --nproc_per_node 2 torchrun_train.py oracle_checkpoint \
        <out_dir> <case>...

oracle, fail: as mp_train.py says.
checkpoint: stage 3 with the optimizer on the CPU, 5 steps, each rank on its share of every
batch; after step 3 (CHECKPOINT_STEP) every rank saves a checkpoint to <out_dir>/ckpt and rank 0
writes the fp32 masters to <out_dir>/saved.pt; every rank writes its losses to
<out_dir>/checkpoint.rank<r>.json, and rank 0 the final masters to <out_dir>/final.pt.
dist_first: the script initialises torch.distributed itself (gloo), as torchrun scripts do, and
all-reduces a tensor on the default group between zinf's steps; 2 steps at stage 2, then every
rank writes the all-reduced value and its losses to <out_dir>/dist_first.rank<r>.json.
oracle_checkpoint: in one job, oracle's cases, then checkpoint with <out_dir>/checkpoint as its
<out_dir>."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import zinf.torch  # noqa: E402
from conftest import make_batches, make_model, zinf_config  # noqa: E402
from mp_train import fail, oracle, shard  # noqa: E402

CHECKPOINT_STEP = 3
CHECKPOINT_STEPS = 5


def checkpoint(out_dir):
    config = zinf_config(3, "cpu", "cpu", stage3_param_persistence_threshold=0)
    model = make_model()
    engine, _, _, _ = zinf.torch.initialize(model=model, config=config,
                                            model_parameters=model.parameters())
    rank, world = engine.global_rank, engine.world_size
    losses = []
    for step, batch in enumerate(make_batches(CHECKPOINT_STEPS)):
        if step == CHECKPOINT_STEP:
            engine.save_checkpoint(os.path.join(out_dir, "ckpt"))
            masters = {name: engine.read_parameter(name) for name in engine._names.values()}
            if rank == 0:
                torch.save(masters, os.path.join(out_dir, "saved.pt"))
        ids, labels = shard(batch, rank, world)
        loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    masters = {name: engine.read_parameter(name) for name in engine._names.values()}
    if rank == 0:
        torch.save(masters, os.path.join(out_dir, "final.pt"))
    with open(os.path.join(out_dir, f"checkpoint.rank{rank}.json"), "w") as f:
        json.dump({"losses": losses, "world_size": world}, f)


def dist_first(out_dir):
    import torch.distributed as dist

    dist.init_process_group(backend="gloo")
    model = make_model()
    engine, _, _, _ = zinf.torch.initialize(model=model, config=zinf_config(2, "cpu"))
    rank, world = engine.global_rank, engine.world_size
    assert (rank, world) == (dist.get_rank(), dist.get_world_size())
    losses, reduced = [], []
    for batch in make_batches(2):
        ids, labels = shard(batch, rank, world)
        loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        # The script's own collective on the default group, between zinf's.
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value)
        reduced.append(value.item())
        engine.step()
        losses.append(loss.item())
    with open(os.path.join(out_dir, f"dist_first.rank{rank}.json"), "w") as f:
        json.dump({"losses": losses, "reduced": reduced}, f)
    engine.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "oracle":
        oracle(out, sys.argv[3:])
    elif mode == "fail":
        fail(out, int(sys.argv[3]), sys.argv[4])
    elif mode == "checkpoint":
        checkpoint(out)
    elif mode == "dist_first":
        dist_first(out)
    elif mode == "oracle_checkpoint":
        oracle(out, sys.argv[3:])
        os.makedirs(os.path.join(out, "checkpoint"), exist_ok=True)
        checkpoint(os.path.join(out, "checkpoint"))
    else:
        raise SystemExit(f"unknown mode {mode}")
