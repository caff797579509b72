"""The Hugging Face Trainer on zinf in two processes under torchrun (python -m
torch.distributed.run --nproc-per-node 2), the way most Trainer scripts are launched: the script
of test_hf_trainer.py (hf_trainer_run.py) with TrainingArguments(use_cpu=True), where Accelerate
initialises torch.distributed's gloo group from torchrun's environment and zinf's engine runs its
collectives on a gloo group of its own made from it. As under mpirun, each rank takes half of the
one-process micro-batch, and the two train as the Trainer without DeepSpeed does in one process
on the whole one, at ZeRO-2 and ZeRO-3; a ZeRO-3 checkpoint resumes bit-identically; `accelerate
launch --multi_gpu`, which starts the processes through torchrun, trains the same. Without
use_cpu=True (Accelerate then counts one process on each rank) the job is refused, saying why
(test_hf_trainer.py checks the refusal of WORLD_SIZE > 1 without RANK: no launcher)."""
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("safetensors", reason="safetensors is not installed")
pytest.importorskip("accelerate", reason="accelerate is not installed: the Trainer reaches "
                    "DeepSpeed (here zinf.deepspeed_compat) through it")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed has no gloo backend in this torch", allow_module_level=True)

from safetensors.torch import load_file  # noqa: E402
from test_hf_trainer import (ACCUMULATION, BATCH, LOSS_REL, RANKS, SAVE_STEPS,  # noqa: E402
                             SCRIPT, STEPS, assert_losses_match, assert_weights_match,
                             free_port, run_trainer, write_config)

# What an MPI launcher or a torchrun around pytest itself would leave in the environment: the
# jobs below must see torchrun's variables only.
LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_SIZE", "PMI_RANK",
                      "PMIX_RANK", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                      "MASTER_ADDR", "MASTER_PORT")


def run_trainer_torchrun(out, *args, fail=False, accelerate_launch=False):
    """Runs hf_trainer_run.py OUT ARGS in RANKS processes under torchrun (with accelerate_launch,
    under `accelerate launch --multi_gpu`, which starts them through torchrun), each with a
    micro-batch of BATCH / RANKS, meeting on a free port. Returns each rank's RESULT, by rank,
    or with fail=True the job's output after asserting that it failed."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false"})
    if accelerate_launch:
        # No accelerate config file of the user's: the flags below are the whole launch.
        env["HF_HOME"] = str(out / "hf_home")
        launcher = ["accelerate.commands.launch", "--multi_gpu", "--num_processes", str(RANKS),
                    "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                    "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port())]
    else:
        launcher = ["torch.distributed.run", "--nproc-per-node", str(RANKS), "--master-addr",
                    "127.0.0.1", "--master-port", str(free_port())]
    done = subprocess.run(
        [sys.executable, "-m", *launcher, SCRIPT, str(out), "--steps", str(STEPS),
         "--save-steps", str(SAVE_STEPS), "--ga", str(ACCUMULATION), "--batch",
         str(BATCH // RANKS), *args],
        capture_output=True, text=True, env=env, timeout=300)
    if fail:
        assert done.returncode != 0, done.stdout[-2000:]
        return done.stdout + done.stderr
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = []
    for rank in range(RANKS):
        with open(os.path.join(out, f"result.rank{rank}.json")) as file:
            results.append(json.load(file))
    assert [(r["rank"], r["world_size"]) for r in results] == [(r, RANKS) for r in range(RANKS)]
    # Every rank logs the same loss: the mean over the ranks.
    assert all(r == results[0] | {"rank": r["rank"]} for r in results), results
    return results


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The script without DeepSpeed in one process on the whole micro-batch, evaluated at each
    save."""
    out = tmp_path_factory.mktemp("baseline")
    result = run_trainer(out, "--eval")
    return result, load_file(str(out / "final" / "model.safetensors"))


@pytest.fixture(scope="module")
def zero3_torchrun(tmp_path_factory):
    """ZeRO-3 in 2 processes, parameters and optimizer offloaded, evaluated at each save."""
    out = tmp_path_factory.mktemp("zero3_torchrun")
    return out, run_trainer_torchrun(out, "--ds", write_config(out / "ds.json", 3), "--eval")


def test_two_processes_at_zero3_train_as_one_process_on_the_whole_batch(baseline,
                                                                         zero3_torchrun):
    out, results = zero3_torchrun
    assert_losses_match(results[0], baseline[0])
    expected = baseline[0]["eval_losses"]
    assert [row[0] for row in results[0]["eval_losses"]] == [SAVE_STEPS, STEPS]
    for (step, loss), (_, loss_ref) in zip(results[0]["eval_losses"], expected):
        assert abs(loss - loss_ref) <= LOSS_REL * abs(loss_ref), (step, loss, loss_ref)
    # save_model gathers the sharded parameters of both ranks; rank 0 writes them.
    assert_weights_match(load_file(str(out / "final" / "model.safetensors")), baseline[1])


def test_two_processes_resume_bit_identically(zero3_torchrun, tmp_path):
    out, uninterrupted = zero3_torchrun
    checkpoint = out / f"checkpoint-{SAVE_STEPS}"
    # Every rank saved its partition and its random state.
    for rank in range(RANKS):
        assert (checkpoint / f"global_step{SAVE_STEPS}" / f"rank{rank}.zinfckpt").is_file()
        assert (checkpoint / f"rng_state_{rank}.pth").is_file()
    resumed = run_trainer_torchrun(tmp_path, "--ds", str(out / "ds.json"), "--resume",
                                   str(checkpoint))
    assert resumed[0]["losses"] == uninterrupted[0]["losses"][SAVE_STEPS:]
    got = load_file(str(tmp_path / "final" / "model.safetensors"))
    expected = load_file(str(out / "final" / "model.safetensors"))
    assert sorted(got) == sorted(expected)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_two_processes_at_zero2_train_and_save_as_one_process(baseline, tmp_path):
    """ZeRO-2: save_model takes the state dict of the parameters every rank holds whole."""
    results = run_trainer_torchrun(tmp_path, "--ds", write_config(tmp_path / "ds.json", 2))
    assert_losses_match(results[0], baseline[0])
    assert_weights_match(load_file(str(tmp_path / "final" / "model.safetensors")), baseline[1])


def test_accelerate_launch_runs_two_processes_as_torchrun_does(baseline, tmp_path):
    """`accelerate launch --multi_gpu` starts the processes through torchrun; the script's
    use_cpu=True keeps them on the CPU."""
    results = run_trainer_torchrun(tmp_path, "--ds", write_config(tmp_path / "ds.json", 2),
                                   accelerate_launch=True)
    assert_losses_match(results[0], baseline[0])


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU Accelerate counts the ranks "
                    "without use_cpu=True")
def test_two_processes_without_use_cpu_are_refused(tmp_path):
    """Without use_cpu=True on a machine without a GPU, Accelerate sees one process on each rank
    and would give each the whole data."""
    output = run_trainer_torchrun(tmp_path, "--ds", write_config(tmp_path / "ds.json", 2),
                                  "--device-default", fail=True)
    assert "NotImplementedError" in output, output[-3000:]
    assert "Accelerate counts 1 process(es) but torchrun started 2" in output, output[-3000:]
    assert "use_cpu=True" in output
