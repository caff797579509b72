"""zinf.torch.Init on two ranks (mpirun, torchrun) with torch.distributed initialised, as
DeepSpeed scripts and the Hugging Face Trainer have it: a GatheredParameters(modifier_rank=r)
block before initialize() broadcasts rank r's values at its end, so every rank reads them from
then on, with no warning, and initialize() takes them. The ranks run init_ranks.py."""
import os
import subprocess
import sys

import pytest
import torch

from _helpers import (free_port, mpirun, torchrun, why_mpirun_unavailable,
                      why_torchrun_unavailable)
from init_model import Stack

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "init_ranks.py")


def launch(launcher, args, timeout=300):
    """Runs init_ranks.py with `args` on two ranks under `launcher`, or in one process ("one")."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "RANK", "WORLD_SIZE",
                        "MASTER_ADDR", "MASTER_PORT")}
    if launcher == "mpirun":
        if why_mpirun_unavailable() is not None:
            pytest.skip(why_mpirun_unavailable())
        # deepspeed.init_distributed() meets the ranks at 127.0.0.1:MASTER_PORT.
        env["MASTER_PORT"] = str(free_port())
        result = mpirun("init_ranks.py", args, timeout, env=env, exported=["MASTER_PORT"])
    elif launcher == "torchrun":
        if why_torchrun_unavailable() is not None:
            pytest.skip(why_torchrun_unavailable())
        result = torchrun("init_ranks.py", args, timeout, env=env)
    else:
        result = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                                timeout=timeout, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    """A GPT-2 of one block of 32, vocabulary 100, seeded, saved as from_pretrained reads it."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("tiny_gpt2")
    torch.manual_seed(3)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100,
                                     n_positions=32, bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["mpirun", "torchrun"])
def two_rank_runs(request, tmp_path_factory, tiny_gpt2):
    out = tmp_path_factory.mktemp(f"init_ranks_{request.param}")
    launch(request.param, [str(out), str(tiny_gpt2), "write", "resize"])
    return out


def test_a_change_on_the_modifier_rank_is_read_on_every_rank_before_initialize(two_rank_runs):
    from init_ranks import LAYERS, WIDTH, write_weights

    weights, half = write_weights()
    expected = dict(weights)
    expected["head.bias"] = torch.full((256,), 0.25)  # set on rank 1, modifier_rank=1
    expected.update({f"half.{n}": p.detach() for n, p in half.named_parameters()})
    assert set(expected) == {n for n, _ in Stack(WIDTH, LAYERS).named_parameters()} | {
        "half.weight", "half.bias"}
    for rank in (0, 1):
        report = torch.load(two_rank_runs / f"write.rank{rank}.pt")
        # What each rank read before initialize(): rank 0's load, rank 1's bias, in their dtypes.
        for name, values in expected.items():
            assert report["seen"][name].dtype == values.dtype, f"rank {rank}: {name}"
            assert torch.equal(report["seen"][name], values), f"rank {rank}: {name}"
        assert report["warnings"] == [], f"rank {rank}"
        assert report["refused"] == ("GatheredParameters(modifier_rank=2): torch.distributed has "
                                     "ranks 0 to 1"), f"rank {rank}"
        for name, values in report["masters"].items():
            assert torch.equal(values, expected[name]), f"rank {rank}: {name}"


def test_resize_token_embeddings_after_a_zero3_from_pretrained(two_rank_runs, tiny_gpt2,
                                                               tmp_path):
    # transformers builds the new embedding rows from the old embeddings' mean and covariance,
    # read on every rank after rank 0 loaded them: each rank now reads rank 0's, and the ranks'
    # new rows agree (initialize() compares them) and are one process's, to the bit.
    from safetensors.torch import load_file

    from init_ranks import NEW_VOCAB

    launch("one", [str(tmp_path), str(tiny_gpt2), "resize"])
    one = torch.load(tmp_path / "resize.w1.rank0.pt")
    assert "error" not in one, one["error"]
    pretrained = load_file(str(tiny_gpt2 / "model.safetensors"))
    old_vocab = pretrained["transformer.wte.weight"].shape[0]
    for rank in (0, 1):
        report = torch.load(two_rank_runs / f"resize.w2.rank{rank}.pt")
        assert "error" not in report, f"rank {rank}: {report['error']}"
        assert report["warnings"] == [], f"rank {rank}"
        masters = report["masters"]
        assert masters["transformer.wte.weight"].shape == (NEW_VOCAB, 32)
        assert torch.equal(masters["transformer.wte.weight"][:old_vocab],
                           pretrained["transformer.wte.weight"]), f"rank {rank}"
        for name, values in pretrained.items():
            if name in masters and name != "transformer.wte.weight":
                assert torch.equal(masters[name], values), f"rank {rank}: {name}"
        assert set(masters) == set(one["masters"])
        for name, values in one["masters"].items():
            assert torch.equal(masters[name], values), f"rank {rank}: {name}"
    # The new rows were drawn around the old rows' mean (transformers scales the covariance by
    # 1e-5: a spread of about 1e-4 here), not left as a fresh embedding's N(0, 0.02) draw.
    new_rows = one["masters"]["transformer.wte.weight"][old_vocab:]
    old_mean = pretrained["transformer.wte.weight"].mean(dim=0)
    assert (new_rows - old_mean).abs().max() < 5e-3


def test_a_block_that_ends_badly_on_one_rank_ends_on_every_rank_at_once(tmp_path):
    """Before initialize(), the end of a GatheredParameters(modifier_rank=0) block is collective
    (init_ranks.py errors, torch.distributed's timeout 20 s): when rank 0 left a parameter with
    another shape every rank raises the same error, naming it and both shapes, and keeps its
    values; when the block raised on rank 1 only, rank 0's values still reach every rank; when it
    raised on rank 0, no rank takes any of its changes. No rank waits for the timeout. Rank 0's
    outcome takes one broadcast (not broadcast_object_list's two)."""
    launch("mpirun", [str(tmp_path), "-", "errors"], timeout=240)
    reports = [torch.load(tmp_path / f"errors.rank{rank}.pt") for rank in (0, 1)]
    shape_error = ("GatheredParameters(modifier_rank=0): Linear.weight has shape (2, 2) at the "
                   "end of the block on rank 0, not its shape (4, 16); change its values, not "
                   "its shape")
    values = reports[0]["set"]
    root_before = reports[0]["before"]
    for rank, report in enumerate(reports):
        assert not torch.equal(report["before"]["weight"], reports[1 - rank]["before"]["weight"])
        assert report["shape"]["error"] == shape_error, f"rank {rank}"
        for name, before in report["before"].items():
            assert torch.equal(report["shape"]["after"][name], before), f"rank {rank}: {name}"
        assert report["raise_other"]["error"] == (
            "the block fails on rank 1" if rank == 1 else None)
        assert torch.equal(report["raise_other"]["after"]["bias"], values), f"rank {rank}"
        assert torch.equal(report["raise_other"]["after"]["weight"], root_before["weight"])
        assert report["raise_root"]["error"] == (
            "the block fails on rank 0" if rank == 0 else None)
        for name, kept in report["raise_other"]["after"].items():
            assert torch.equal(report["raise_root"]["after"][name], kept), f"rank {rank}: {name}"
        for case in ("shape", "raise_other", "raise_root"):
            assert report[case]["seconds"] < 15, f"rank {rank}: {case}"
        # Rank 0's outcome is one broadcast; then the values (one dtype), or a changed shape.
        assert [report[case]["broadcasts"] for case in ("shape", "raise_other", "raise_root")] \
            == [2, 2, 1], f"rank {rank}"
