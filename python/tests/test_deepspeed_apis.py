"""DeepSpeed APIs a ported script calls beyond the training step, over zinf.deepspeed_compat:
RepeatingLoader and engine.training_dataloader, and deepspeed.comm's reduce,
all_gather_into_tensor, reduce_scatter_tensor, get_global_rank, new_group and send/recv on two
ranks under torchrun. Each is checked against torch (the samplers' orders, torch.distributed's
semantics on each rank's seeded inputs) with DeepSpeed's behaviour (deepspeed/runtime/
dataloader.py and engine.py, comm/comm.py) written out in the test."""
import os
import socket
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

import zinf.deepspeed_compat as compat
from conftest import make_mlp, mlp_config

HERE = os.path.dirname(os.path.abspath(__file__))


def ds_initialize(**kwargs):
    """deepspeed.initialize in this process without initialising torch.distributed (the other
    tests of the session expect it untouched); zinf's engine does not use it."""
    return compat.initialize(dist_init_required=False, **kwargs)


def test_training_dataloader_and_repeating_loader_follow_deepspeeds():
    dataset = TensorDataset(torch.arange(10, dtype=torch.float32).unsqueeze(1))
    config = mlp_config(1)
    batch = config["train_micro_batch_size_per_gpu"]
    engine, _, loader, _ = ds_initialize(model=make_mlp(), config=config, training_data=dataset)
    # DeepSpeed's engine keeps the loader it returns as engine.training_dataloader.
    assert loader is not None and engine.training_dataloader is loader
    engine.destroy()
    engine, _, none, _ = ds_initialize(model=make_mlp(), config=config)
    assert none is None and engine.training_dataloader is None
    engine.destroy()

    def order(epoch):
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0)
        sampler.set_epoch(epoch)
        return [int(i) for i in sampler]

    # RepeatingLoader starts the loader again when it ends: the passes follow one another, each
    # a new epoch of the loader's sampler (10 samples in batches of 4: 4, 4, 2 per pass).
    repeating = compat.RepeatingLoader(loader)
    assert iter(repeating) is repeating
    assert batch == 4
    seen = [int(v) for _ in range(8) for v in next(repeating)[0].flatten()]
    assert seen == (order(0) + order(1) + order(2))[:28]


# ---- two ranks under torchrun ------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed has no gloo backend in this torch")
    out = tmp_path_factory.mktemp("deepspeed_apis")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
               os.path.join(HERE, "deepspeed_apis_run.py"), str(out)]
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def test_deepspeed_comm_collectives_follow_torch_distributed(two_rank_run):
    from deepspeed_apis_run import WORLD, comm_inputs

    inputs = [comm_inputs(rank) for rank in range(WORLD)]
    results = [torch.load(two_rank_run / f"comm.rank{rank}.pt") for rank in range(WORLD)]
    total = {key: sum(i[key] for i in inputs) for key in inputs[0]}
    # reduce(dst=1): rank 1 holds the sum.
    assert torch.allclose(results[1]["reduce"], total["reduce"], rtol=1e-6)
    gathered = torch.cat([i["gather"] for i in inputs])
    scatter = total["scatter"].reshape(WORLD, -1)
    for rank, result in enumerate(results):
        assert torch.equal(result["all_gather_into_tensor"], gathered), rank
        assert torch.allclose(result["reduce_scatter_tensor"], scatter[rank], rtol=1e-6), rank
        assert torch.allclose(result["new_group_all_reduce"], total["group"], rtol=1e-6), rank
        assert result["get_global_rank"].tolist() == [0, 1, 1], rank
    assert torch.equal(results[1]["recv"], inputs[0]["send"])


