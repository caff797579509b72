"""Two processes under mpirun (zinf.torch on MpiComm): the oracle's GPT-2 trained with each rank
on half of every batch must end where plain torch ends on the full batch in one process, and a
rank that raises must make the other fail promptly, naming it. The ranks run mp_train.py."""
import json
import time

import pytest
import torch

from _helpers import mpirun as run_mpirun, why_mpirun_unavailable
from conftest import (RANK_1_RAISES, assert_rank_0_failed_naming_rank_1,
                      assert_two_ranks_match_torch, make_model)

CASES = [f"{stage}-{offload}" for stage in (1, 2, 3) for offload in ("none", "cpu", "nvme")]

pytestmark = pytest.mark.skipif(why_mpirun_unavailable() is not None,
                                reason=str(why_mpirun_unavailable()))


def mpirun(args, timeout, ranks=2):
    return run_mpirun("mp_train.py", args, timeout, ranks)


@pytest.fixture(scope="module")
def several_runs(tmp_path_factory):
    """One mpirun job: mp_train.py's oracle CASES, then its write, init_write (roots 0 and 1),
    loader and consolidated modes one after another, each mode's files in a folder of its own,
    named after it."""
    out = tmp_path_factory.mktemp("mp_several")
    result = mpirun(["several", str(out), *CASES], timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_match_torch_on_the_full_batch(case, several_runs, torch_reference):
    assert_two_ranks_match_torch(several_runs, case, torch_reference, "mpirun")


def test_a_change_made_on_the_modifier_rank_reaches_every_rank(several_runs):
    expected = torch.linspace(0.5, 1.5, 64)
    for rank in (0, 1):
        with open(several_runs / "write" / f"write.rank{rank}.json") as f:
            report = json.load(f)
        assert torch.equal(torch.tensor(report["master"]), expected), f"rank {rank}"


@pytest.mark.parametrize("root", [0, 1])
def test_a_change_before_initialize_reaches_every_ranks_partition(root, several_runs):
    # Under Init each rank stages its own values; weights loaded on rank `root` only inside
    # GatheredParameters(modifier_rank=root) are in every rank's partition of the masters. (Each
    # rank's partition was filled from its own staging file: root 1 failed, and root 0 with a
    # model whose partition on rank 1 holds more, two Linear(64, 512) layers.)
    for rank in (0, 1):
        with open(several_runs / f"init_write{root}" / f"init_write.rank{rank}.json") as f:
            assert json.load(f)["worst"] == 0.0, f"rank {rank}"


def test_a_model_built_with_a_seed_per_rank_is_refused_naming_a_parameter(tmp_path):
    # Each rank would keep its own partition of different values; finalize compares the staged
    # values' hashes across ranks.
    # (The ranks' exit is not checked: initialize() aborted the communicator before raising.)
    result = mpirun(["init_write", str(tmp_path), "-1"], timeout=600)
    for rank in (0, 1):
        report = tmp_path / f"init_write.rank{rank}.json"
        assert report.exists(), result.stdout[-3000:] + result.stderr[-3000:]
        with open(report) as f:
            error = json.load(f)["error"]
        assert error is not None and "has different initial values on rank 0 and rank 1" in error, \
            error


def test_each_rank_reads_its_own_share_of_the_training_data(several_runs):
    # DeepSpeed's loader under mpirun: a DistributedSampler over the ranks (shuffled, seed 0),
    # its epoch advanced with each pass; the ranks' shares of a pass are disjoint and cover the
    # data.
    seen = []
    for rank in (0, 1):
        with open(several_runs / "loader" / f"loader.rank{rank}.json") as f:
            report = json.load(f)
        assert report["world_size"] == 2
        for epoch, samples in enumerate(report["passes"]):
            sampler = torch.utils.data.DistributedSampler(range(40), num_replicas=2, rank=rank)
            sampler.set_epoch(epoch)
            assert samples == list(sampler), f"rank {rank}, pass {epoch}"
        seen.append(report["passes"][0])
    assert sorted(seen[0] + seen[1]) == list(range(40))


def test_the_consolidated_16bit_state_dict_is_on_rank_0_only(several_runs):
    # DeepSpeed's _zero3_consolidated_16bit_state_dict over two processes at stage 3: rank 0
    # holds every parameter (under each of its names) as the master rounded to bf16, and the
    # model's buffers; rank 1 gets None.
    out = several_runs / "consolidated"
    with open(out / "consolidated.rank1.json") as f:
        assert json.load(f) == {"none": True}
    state = torch.load(out / "consolidated.pt")
    masters = torch.load(out / "masters.pt")
    assert list(state) == list(make_model().state_dict())
    for name, master in masters.items():
        assert state[name].dtype == torch.bfloat16
        assert torch.equal(state[name], master.to(torch.bfloat16)), name


@pytest.mark.parametrize("where,said", RANK_1_RAISES)
def test_an_exception_on_rank_1_fails_rank_0_promptly_naming_it(where, said, tmp_path):
    # Raised inside engine.backward(), or in the script's loop between the engine's calls (an
    # uncaught exception: zinf.torch's sys.excepthook aborts the communicator). (Rank 1's own
    # traceback may never be printed: it lingers so that rank 0 reports first, and mpirun kills
    # the job as soon as rank 0 exits non-zero.)
    timeout_ms = 30_000
    result = mpirun(["fail", str(tmp_path), str(timeout_ms), where], timeout=180)
    elapsed = assert_rank_0_failed_naming_rank_1(result, time.time(), said, "mpirun")
    # The acceptance bound is the collective timeout plus 10 s; rank 0 was told by an abort
    # notice, so the job ends before the timeout itself (rank 1 lingers 5 s, ZINF_ABORT_LINGER_S,
    # so that rank 0 reports before mpirun kills the job).
    assert elapsed < timeout_ms / 1000
