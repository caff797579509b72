"""Run by torchrun from test_deepspeed_apis.py (two ranks): a DeepSpeed script's calls of
deepspeed.comm and deepspeed.utils over zinf.deepspeed_compat.

    python -m torch.distributed.run --nproc_per_node 2 deepspeed_apis_run.py <out_dir>

deepspeed.comm: each rank's seeded inputs (comm_inputs(rank)) through reduce,
all_gather_into_tensor, reduce_scatter_tensor, an all_reduce on new_group(all ranks), send/recv
and get_global_rank; the results go to <out_dir>/comm.rank<r>.pt.
deepspeed.utils: the MLP at ZeRO-3 (optimizer on the CPU), each rank on its half of every batch,
STEPS steps; then every parameter's safe_get_full_fp32_param and
safe_get_full_optimizer_state(exp_avg, exp_avg_sq) go to <out_dir>/state.rank<r>.pt."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import zinf.deepspeed_compat  # noqa: E402

zinf.deepspeed_compat.install()

import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402

from conftest import make_mlp, mlp_batches, mlp_config, mlp_loss  # noqa: E402

STEPS = 3
WORLD = 2


def comm_inputs(rank: int) -> dict:
    generator = torch.Generator().manual_seed(100 + rank)
    return {name: torch.randn(shape, generator=generator)
            for name, shape in (("reduce", 5), ("gather", 3), ("scatter", 2 * WORLD),
                                ("group", 4), ("send", 6))}


def run_comm(rank: int, out_dir: str):
    inputs = comm_inputs(rank)
    results = {}
    reduced = inputs["reduce"].clone()
    dist.reduce(reduced, dst=1)
    if rank == 1:
        results["reduce"] = reduced
    gathered = torch.zeros(3 * WORLD)
    dist.all_gather_into_tensor(gathered, inputs["gather"])
    results["all_gather_into_tensor"] = gathered
    scattered = torch.zeros(2)
    dist.reduce_scatter_tensor(scattered, inputs["scatter"].clone())
    results["reduce_scatter_tensor"] = scattered
    group = dist.new_group(list(range(WORLD)))
    summed = inputs["group"].clone()
    dist.all_reduce(summed, group=group)
    results["new_group_all_reduce"] = summed
    results["get_global_rank"] = torch.tensor([dist.get_global_rank(group, r)
                                               for r in range(WORLD)]
                                              + [dist.get_global_rank(None, 1)])
    if rank == 0:
        dist.send(inputs["send"], dst=1)
    else:
        received = torch.zeros(6)
        dist.recv(received, src=0)
        results["recv"] = received
    torch.save(results, os.path.join(out_dir, f"comm.rank{rank}.pt"))


def run_state(rank: int, out_dir: str):
    model = make_mlp()
    engine, _, _, _ = deepspeed.initialize(model=model, config=mlp_config(3, "cpu"))
    for x, y in mlp_batches(STEPS):
        half = x.shape[0] // WORLD
        batch = (x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half])
        engine.backward(mlp_loss(engine, batch))
        engine.step()
    state = {}
    for name, param in model.named_parameters():
        state[name] = {"fp32": safe_get_full_fp32_param(param),
                       "exp_avg": safe_get_full_optimizer_state(param, "exp_avg"),
                       "exp_avg_sq": safe_get_full_optimizer_state(param, "exp_avg_sq")}
    torch.save(state, os.path.join(out_dir, f"state.rank{rank}.pt"))
    engine.destroy()


if __name__ == "__main__":
    deepspeed.init_distributed()
    out = sys.argv[1]
    run_comm(dist.get_rank(), out)
    run_state(dist.get_rank(), out)
    # Every rank is done with its collectives before the group goes: a rank that exits first
    # would leave the other's gloo connections to fail as it exits.
    dist.barrier()
    torch.distributed.destroy_process_group()
