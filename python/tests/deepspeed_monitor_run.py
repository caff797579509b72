"""Run by torchrun from test_deepspeed_monitor.py (two ranks): a DeepSpeed script with the
config's csv_monitor on, over zinf.deepspeed_compat.

    python -m torch.distributed.run --nproc_per_node 2 deepspeed_monitor_run.py <out_dir>

Each rank trains the MLP at ZeRO-2 on batches of its own seed (so the ranks' losses differ),
gradient_accumulation_steps 2, STEPS optimizer steps, the csv_monitor writing to
<out_dir>/logs/run2/; each rank writes the losses its forward returned to
<out_dir>/losses.rank<r>.json. Then every rank writes an event of its own, "Custom/rank", and
calls see_memory_usage(force=True) (rank 0 alone writes and prints)."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import zinf.deepspeed_compat  # noqa: E402

zinf.deepspeed_compat.install()

import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
from deepspeed.runtime.utils import see_memory_usage  # noqa: E402

from conftest import make_mlp, mlp_batches, mlp_config, mlp_loss  # noqa: E402

STEPS = 2
GAS = 2


def main(out_dir: str):
    deepspeed.init_distributed()
    rank = dist.get_rank()
    config = mlp_config(2)
    config["gradient_accumulation_steps"] = GAS
    config["csv_monitor"] = {"enabled": True, "output_path": os.path.join(out_dir, "logs"),
                             "job_name": "run2"}
    engine, _, _, _ = deepspeed.initialize(model=make_mlp(), config=config)
    losses = []
    for batch in mlp_batches(STEPS * GAS, seed=40 + rank):
        loss = mlp_loss(engine, batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    # A script's own event, written by every rank: only rank 0's reaches the file.
    engine.monitor.write_events([("Custom/rank", rank, 5)])
    see_memory_usage(f"memory of rank {rank}", force=True)
    with open(os.path.join(out_dir, f"losses.rank{rank}.json"), "w") as f:
        json.dump({"losses": losses, "monitor_enabled": engine.monitor.enabled,
                   "train_batch_size": engine.train_batch_size()}, f)
    engine.destroy()
    dist.barrier()
    import torch

    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
