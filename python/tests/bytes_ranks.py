"""Run by test_binding.py under mpirun (the "mpi" communicator) or torchrun (the "torch" one):
the binding's broadcast_bytes and all_gather_bytes on two ranks. For each size of SIZES every
rank fills a buffer with bytes drawn from a seed of its own (drawn(size, rank)) and broadcasts
it from each root in turn, then all-gathers it; every rank writes what it held after each
broadcast, and what it gathered, to <out_dir>/bytes.rank<r>.pt.

    mpirun -np 2 python bytes_ranks.py <out_dir> mpi
    python -m torch.distributed.run --nproc_per_node 2 bytes_ranks.py <out_dir> torch"""
import json
import os
import sys

import torch

import zinf
import zinf.torch

# Odd sizes (the last byte moves in a pair of its own, and the gathered ones move up into
# place) and even ones around them.
SIZES = (1, 2, 3, 4096, 4097)


def drawn(size: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * size + rank)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)


def main(out_dir: str, comm: str):
    torch.set_num_threads(1)
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 1}, "zinf": {"cpu_threads": 1}}
    transport = zinf.torch._make_transport(comm, config)
    engine = zinf.Engine(json.dumps(config), [], 0, comm, transport)
    rank, world_size = engine.rank, engine.world_size
    received = {}
    for size in SIZES:
        for root in range(world_size):
            buffer = drawn(size, rank)
            engine.broadcast_bytes(buffer, root, f"{size} bytes from rank {root}")
            received[(size, root)] = buffer
    gathered = {}
    for size in SIZES:
        # Each rank's slot filled beforehand with bytes no rank sends.
        recv = torch.full((world_size, size), 0xA5, dtype=torch.uint8)
        engine.all_gather_bytes(drawn(size, rank), recv, f"{size} bytes from every rank")
        gathered[size] = recv
    engine.close()
    torch.save({"world_size": world_size, "received": received, "gathered": gathered},
               os.path.join(out_dir, f"bytes.rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
