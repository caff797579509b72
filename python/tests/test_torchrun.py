"""Two processes under torchrun (python -m torch.distributed.run; zinf.torch on its "torch"
communicator, a gloo group of torch.distributed): the oracle's GPT-2 trained with each rank on
half of every batch must end where plain torch ends on the full batch in one process, a
checkpoint saved under torchrun must load in one process with the same masters and go on from
there, and a rank that raises must make the other fail promptly, naming it. The ranks run
torchrun_train.py."""
import json
import time

import pytest
import torch

import zinf.torch
from _helpers import torchrun as run_torchrun, why_torchrun_unavailable
from conftest import (RANK_1_RAISES, assert_rank_0_failed_naming_rank_1,
                      assert_two_ranks_match_torch, make_batches, make_model, relative_errors,
                      zinf_config)
from mp_train import shard
from torchrun_train import CHECKPOINT_STEP, CHECKPOINT_STEPS

CASES = ["1-cpu", "2-cpu", "3-cpu", "3-nvme"]

pytestmark = pytest.mark.skipif(why_torchrun_unavailable() is not None,
                                reason=str(why_torchrun_unavailable()))


def torchrun(args, timeout):
    return run_torchrun("torchrun_train.py", args, timeout)


@pytest.fixture(scope="module")
def oracle_runs(tmp_path_factory):
    """One torchrun job: torchrun_train.py's oracle CASES, then its checkpoint mode (its files in
    the folder checkpoint)."""
    out = tmp_path_factory.mktemp("torchrun_oracle")
    result = torchrun(["oracle_checkpoint", str(out), *CASES], timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_under_torchrun_match_torch_on_the_full_batch(case, oracle_runs,
                                                                torch_reference):
    assert_two_ranks_match_torch(oracle_runs, case, torch_reference, "torchrun")


def test_a_checkpoint_saved_under_torchrun_resumes_in_one_process(oracle_runs):
    tmp_path = oracle_runs / "checkpoint"
    saved = torch.load(tmp_path / "saved.pt")
    final = torch.load(tmp_path / "final.pt")
    rank_losses = []
    for rank in (0, 1):
        with open(tmp_path / f"checkpoint.rank{rank}.json") as f:
            rank_losses.append(json.load(f)["losses"])

    model = make_model()
    config = zinf_config(3, "cpu", "cpu", stage3_param_persistence_threshold=0)
    engine, _, _, _ = zinf.torch.initialize(model=model, config=config,
                                            model_parameters=model.parameters(), comm="local")
    try:
        assert engine.world_size == 1
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        # The two ranks' partitions of the masters, resharded into one: the same bits.
        for name, expected in saved.items():
            assert torch.equal(engine.read_parameter(name), expected), name
        batches = make_batches(CHECKPOINT_STEPS)
        # The loaded model gives each rank's loss of the next step, to the bit.
        with torch.no_grad():
            for rank in (0, 1):
                ids, labels = shard(batches[CHECKPOINT_STEP], rank, 2)
                loss = engine(input_ids=ids, labels=labels).loss.item()
                assert loss == rank_losses[rank][CHECKPOINT_STEP], f"rank {rank}"
        # And it trains on from there (optimizer moments and step count included) to where the
        # two ranks ended, on the full batches.
        for ids, labels in batches[CHECKPOINT_STEP:]:
            engine.backward(engine(input_ids=ids, labels=labels).loss)
            engine.step()
        params = {name: engine.read_parameter(name) for name in final}
    finally:
        engine.destroy()
    model_error, worst = relative_errors(params, final)
    print(f"resumed in one process: relative error of the model {model_error:.2e}, of the worst "
          f"parameter {worst:.2e}")
    assert model_error < 1e-5
    assert worst < 1e-5


def test_a_script_that_initialised_torch_distributed_keeps_its_default_group(tmp_path,
                                                                               oracle_runs):
    # zinf's collectives run on a gloo group of their own: the script's all_reduce on the
    # default group between them gets its own sum, and each rank's losses are, to the bit, the
    # first two of the oracle run at stage 2 (the same model, data and config).
    result = torchrun(["dist_first", str(tmp_path)], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for rank in (0, 1):
        with open(tmp_path / f"dist_first.rank{rank}.json") as f:
            report = json.load(f)
        with open(oracle_runs / f"2-cpu.rank{rank}.json") as f:
            oracle = json.load(f)
        assert report["reduced"] == [3.0, 3.0], f"rank {rank}"
        assert report["losses"] == oracle["losses"][:2], f"rank {rank}"


@pytest.mark.parametrize("where,said", RANK_1_RAISES)
def test_an_exception_on_rank_1_fails_rank_0_promptly_naming_it(where, said, tmp_path):
    # Raised inside engine.backward(), or in the script's loop between the engine's calls (an
    # uncaught exception: zinf.torch's sys.excepthook aborts the communicator). Rank 0 learns of
    # it from the abort notice rank 1 posts in the group's store.
    timeout_ms = 30_000
    result = torchrun(["fail", str(tmp_path), str(timeout_ms), where], timeout=120)
    elapsed = assert_rank_0_failed_naming_rank_1(result, time.time(), said, "torchrun")
    # Rank 0 fails at once; torchrun then stops rank 1, which lingers 5 s (ZINF_ABORT_LINGER_S)
    # after its abort. Well below the collective timeout (30 s), with room for a loaded machine.
    assert elapsed < 20
