"""DeepSpeed APIs a ported script calls beyond the training step, over zinf.deepspeed_compat:
deepspeed.comm's reduce, all_gather_into_tensor, reduce_scatter_tensor, get_global_rank,
new_group and send/recv on two ranks under torchrun, checked against torch.distributed's
semantics (DeepSpeed's deepspeed/comm/comm.py passes each call to torch.distributed's) on each
rank's seeded inputs."""
import os
import socket
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


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


