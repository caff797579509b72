"""The Hugging Face Trainer on zinf through zinf.deepspeed_compat: an unchanged Trainer script
(hf_trainer_run.py, with install() added) given TrainingArguments(deepspeed=<config>) trains as
the same script without DeepSpeed does, at ZeRO-2 and ZeRO-3 with two micro-batches a step and
the Trainer's own AdamW and schedule; a checkpoint resumes bit-identically; save_model at stage 3
writes the trained weights. Under mpirun, torchrun and `accelerate launch --multi_gpu` the same
script in 2 processes, each with half the micro-batch, trains as one process on the whole one.
Each job runs in fresh processes (install() must come before transformers is imported, and a
launcher's environment is its processes'); one job trains the cases of one launcher one after
another, the script clearing Accelerate's and transformers' process-wide state between them,
and each test asserts on its case's results."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("safetensors", reason="safetensors is not installed")
pytest.importorskip("accelerate", reason="accelerate is not installed: the Trainer reaches "
                    "DeepSpeed (here zinf.deepspeed_compat) through it; scripts/lib.sh installs "
                    "it into build/venv")

from safetensors.torch import load_file  # noqa: E402

import zinf.torch  # noqa: E402
from _helpers import free_port  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_trainer_run.py")
STEPS, SAVE_STEPS, ACCUMULATION = 6, 3, 2
# zinf's fp32 AdamW and gradient reduction against torch's: the same maths in another order of
# float operations, over 6 steps. Measured: losses within 1e-7 relative, the weights within
# 6e-7 relative L2 and 3e-6 per element.
LOSS_REL, WEIGHT_REL, WEIGHT_ABS = 1e-5, 1e-5, 2e-5
TRAINING = ["--steps", str(STEPS), "--save-steps", str(SAVE_STEPS), "--ga", str(ACCUMULATION)]


def run_trainer(out, *args, fail=False, env=None, timeout=300):
    """Runs hf_trainer_run.py OUT ARGS in a fresh process. Returns its RESULT (losses: [step,
    loss, grad_norm, lr] rows), or with fail=True its stderr after asserting that it failed."""
    env = {**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    done = subprocess.run([sys.executable, SCRIPT, str(out), *TRAINING, *args],
                          capture_output=True, text=True, env=env, timeout=timeout)
    if fail:
        assert done.returncode != 0, done.stdout[-2000:]
        return done.stderr
    assert done.returncode == 0, done.stderr[-4000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def read_result(out, rank=0):
    """The RESULT a case of a --cases job wrote to OUT, or its traceback as the failure."""
    error = os.path.join(out, "error.txt")
    if os.path.exists(error):
        with open(error) as file:
            pytest.fail(f"the case writing {out} failed:\n{file.read()[-4000:]}")
    with open(os.path.join(out, f"result.rank{rank}.json")) as file:
        return json.load(file)


def run_cases(out, cases):
    """Runs hf_trainer_run.py --cases in one fresh process: each case [OUT, ARGS...] trained one
    after another as run_trainer would train it; read_result(OUT) reads each one's RESULT."""
    env = {**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cases = [[str(case[0]), *TRAINING, *[str(part) for part in case[1:]]] for case in cases]
    (out / "cases.json").write_text(json.dumps(cases))
    done = subprocess.run([sys.executable, SCRIPT, "--cases", str(out / "cases.json")],
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]


def write_config(path, stage, gather_on_save=True):
    """A Hugging Face style DeepSpeed config: "auto" wherever the Trainer fills a value in, and
    no optimizer section (the Trainer's AdamW is used)."""
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update({"offload_param": {"device": "cpu", "pin_memory": True},
                     "stage3_prefetch_bucket_size": "auto",
                     "stage3_param_persistence_threshold": 0,
                     "stage3_gather_16bit_weights_on_model_save": gather_on_save})
    config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
              "zero_optimization": zero, "steps_per_print": 2000, "zinf": {"cpu_threads": 1}}
    path.write_text(json.dumps(config))
    return str(path)


def assert_losses_match(got, expected, rel=LOSS_REL):
    assert [row[0] for row in got["losses"]] == list(range(1, STEPS + 1))
    assert [row[0] for row in got["losses"]] == [row[0] for row in expected["losses"]]
    for (step, loss, norm, lr), (_, loss_ref, norm_ref, lr_ref) in zip(got["losses"],
                                                                       expected["losses"]):
        assert abs(loss - loss_ref) <= rel * abs(loss_ref), (step, loss, loss_ref)
        assert abs(norm - norm_ref) <= 10 * rel * abs(norm_ref), (step, norm, norm_ref)
        assert lr == pytest.approx(lr_ref, rel=1e-12, abs=0.0), (step, lr, lr_ref)


def assert_weights_match(got: dict, expected: dict):
    """The relative L2 difference over all weights within WEIGHT_REL, and every element within
    WEIGHT_ABS. Per tensor the relative difference is no measure here: the key third of each
    c_attn.bias has a gradient that is zero up to rounding (softmax does not change when a
    constant is added to every score of a row), and AdamW turns that rounding noise into steps
    of the learning rate's size in either run."""
    assert sorted(got) == sorted(expected)
    squares = norms = 0.0
    for name, reference in expected.items():
        assert got[name].shape == reference.shape, name
        difference = got[name].float() - reference.float()
        worst = difference.abs().max().item()
        assert worst <= WEIGHT_ABS, f"{name}: an element differs by {worst:.2e}"
        squares += difference.pow(2).sum().item()
        norms += reference.float().pow(2).sum().item()
    assert (squares / norms) ** 0.5 < WEIGHT_REL, (squares / norms) ** 0.5


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The one-process trainings, in one job: the script without DeepSpeed (plain torch under the
    Trainer, evaluated at each save), and the cases the tests below compare with it, each in
    ROOT/<case>."""
    root = tmp_path_factory.mktemp("single")
    ds2, ds3 = write_config(root / "ds2.json", 2), write_config(root / "ds3.json", 3)
    lora = [[f"lora{stage}", "--ds", config, "--lora"] for stage, config in ((2, ds2), (3, ds3))
            if importlib.util.find_spec("peft") is not None]
    run_cases(root, [[root / name, *args] for name, *args in [
        ["baseline", "--eval"],
        # The token embedding frozen, without DeepSpeed.
        ["frozen_plain", "--freeze"],
        ["zero2", "--ds", ds2],
        # ZeRO-3 with parameters and optimizer offloaded, the 16-bit weights gathered on save.
        ["zero3", "--ds", ds3],
        ["zero3_resumed", "--ds", ds3, "--resume", root / "zero3" / f"checkpoint-{SAVE_STEPS}"],
        ["zero3_not_gathered", "--ds", write_config(root / "ds3_not_gathered.json", 3, False)],
        ["zero3_gc", "--ds", ds3, "--gc", "--eval"],
        ["frozen2", "--ds", ds2, "--freeze"],
        ["frozen3", "--ds", ds3, "--freeze"],
        *[case for name, *args in lora for case in (
            [name, *args],
            [f"{name}_resumed", *args, "--resume", root / name / f"checkpoint-{SAVE_STEPS}"])],
    ]])
    return root


@pytest.fixture(scope="module")
def baseline(single):
    """The script without DeepSpeed: its RESULT and its saved weights."""
    return read_result(single / "baseline"), load_file(str(single / "baseline" / "final" /
                                                           "model.safetensors"))


def test_zero2_trains_as_the_trainer_without_deepspeed(baseline, single):
    assert_losses_match(read_result(single / "zero2"), baseline[0])
    assert_weights_match(load_file(str(single / "zero2" / "final" / "model.safetensors")),
                         baseline[1])


def test_zero3_trains_and_saves_as_the_trainer_without_deepspeed(baseline, single):
    assert_losses_match(read_result(single / "zero3"), baseline[0])
    # save_model at stage 3 gathers the sharded parameters into one state dict.
    assert_weights_match(load_file(str(single / "zero3" / "final" / "model.safetensors")),
                         baseline[1])


def test_zero3_resume_is_bit_identical(single):
    out = single / "zero3"
    uninterrupted = read_result(out)
    checkpoint = out / f"checkpoint-{SAVE_STEPS}"
    assert (checkpoint / "latest").read_text().strip() == f"global_step{SAVE_STEPS}"
    resumed = read_result(single / "zero3_resumed")
    assert resumed["losses"] == uninterrupted["losses"][SAVE_STEPS:]
    got = load_file(str(single / "zero3_resumed" / "final" / "model.safetensors"))
    expected = load_file(str(out / "final" / "model.safetensors"))
    assert sorted(got) == sorted(expected)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_zero3_without_gathering_saves_a_checkpoint(baseline, single):
    """Without stage3_gather_16bit_weights_on_model_save, save_model writes a zinf checkpoint
    (the Trainer calls save_checkpoint twice for each one; the second is skipped), whose fp32
    weights are the trained ones."""
    assert_losses_match(read_result(single / "zero3_not_gathered"), baseline[0])
    final = single / "zero3_not_gathered" / "final"
    assert (final / "latest").read_text().strip() == f"global_step{STEPS}"
    weights = zinf.torch.get_fp32_state_dict_from_zero_checkpoint(str(final))
    assert_weights_match({k: v for k, v in weights.items() if k in baseline[1]}, baseline[1])


def test_zero3_with_gradient_checkpointing_evaluates_as_without_deepspeed(baseline, single):
    """Gradient checkpointing recomputes the forward in the backward (each recomputed module
    gathered again at stage 3) and changes no value; evaluate() runs the stage-3 model."""
    result = read_result(single / "zero3_gc")
    assert_losses_match(result, baseline[0])
    expected = baseline[0]["eval_losses"]
    assert [row[0] for row in result["eval_losses"]] == [row[0] for row in expected] == [
        SAVE_STEPS, STEPS]
    for (step, loss), (_, loss_ref) in zip(result["eval_losses"], expected):
        assert abs(loss - loss_ref) <= LOSS_REL * abs(loss_ref), (step, loss, loss_ref)


@pytest.mark.parametrize("stage", [2, 3])
def test_frozen_parameters_train_as_without_deepspeed(stage, single):
    # The token embedding (tied to lm_head) frozen: the run on zinf follows the Trainer's without
    # DeepSpeed, and the frozen weights come out as they went in. At ZeRO-2 the engine does not
    # hold it; at ZeRO-3 it is an engine parameter registered frozen, partitioned and gathered
    # (with lm_head's forward too, which ties it) but never stepped.
    plain = read_result(single / "frozen_plain")
    zinf_run = read_result(single / f"frozen{stage}")
    assert_losses_match(zinf_run, plain)
    got = load_file(str(single / f"frozen{stage}" / "final" / "model.safetensors"))
    expected = load_file(str(single / "frozen_plain" / "final" / "model.safetensors"))
    assert_weights_match(got, expected)
    assert torch.equal(got["transformer.wte.weight"], expected["transformer.wte.weight"])


@pytest.mark.parametrize("stage", [2, 3])
def test_a_lora_run_resumes_bit_identically(stage, single):
    # peft's LoRA through the Trainer: its checkpoints leave the frozen base out
    # (exclude_frozen_parameters) and its resume loads them with load_module_strict=False.
    pytest.importorskip("peft")
    uninterrupted = read_result(single / f"lora{stage}")
    resumed = read_result(single / f"lora{stage}_resumed")
    assert resumed["losses"] == uninterrupted["losses"][SAVE_STEPS:]


def run_python(code, extra_path=None):
    env = dict(os.environ)
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(extra_path), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, timeout=120)


def test_install_answers_for_deepspeed():
    done = run_python("""
        import importlib.metadata, importlib.util, sys
        import zinf.deepspeed_compat as compat
        assert importlib.util.find_spec("deepspeed") is None
        compat.install()
        compat.install()
        import deepspeed, deepspeed.comm, deepspeed.runtime.zero.partition_parameters
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        assert deepspeed.__version__ == compat.VERSION == "0.18.0+zinf"
        assert importlib.util.find_spec("deepspeed") is not None
        assert importlib.metadata.version("deepspeed") == compat.VERSION
        assert importlib.metadata.metadata("deepspeed")["Name"] == "deepspeed"
        assert sys.meta_path.count(compat._finder) == 1
        try:
            import deepspeed.runtime.sequence_parallel.ulysses_sp
        except ModuleNotFoundError as error:
            assert "sequence parallelism is not supported" in str(error), error
        else:
            raise AssertionError("sequence parallelism imported")
        print("ok")
        """)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_install_refuses_a_real_deepspeed(tmp_path):
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "__init__.py").write_text("REAL = True\n")
    done = run_python("""
        import zinf.deepspeed_compat as compat
        try:
            compat.install()
        except RuntimeError as error:
            print("refused:", error)
        compat.install(force=True)
        import deepspeed
        assert not hasattr(deepspeed, "REAL") and deepspeed.__version__ == compat.VERSION
        """, extra_path=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused:" in done.stdout and "a deepspeed package is importable" in done.stdout
    assert "force=True" in done.stdout


# ---- two processes under mpirun -----------------------------------------------------------------
# Each rank takes a micro-batch of BATCH / 2 and the Trainer's sampler (Accelerate's
# BatchSamplerShard over the one seeded permutation) gives rank r the r-th of each pair of those
# micro-batches: together the two ranks' micro-batches are the one process's micro-batch of
# BATCH. zinf averages the ranks' gradients, so every step is the baseline's up to the order of
# float operations, and the loss the Trainer logs, gathered over the ranks and averaged, is the
# whole micro-batches' (the ranks' halves have as many tokens).

BATCH, RANKS = 4, 2
# The launchers of several processes: mpirun, and torchrun (python -m torch.distributed.run),
# the way most Trainer scripts are launched. Under mpirun install() sets torch.distributed's
# environment from the launcher's and the engine runs its collectives on its MPI communicator;
# under torchrun Accelerate initialises the gloo group from torchrun's environment and the engine
# runs its collectives on a gloo group of its own made from it.
LAUNCHERS = [
    pytest.param("mpirun", marks=pytest.mark.skipif(
        shutil.which("mpirun") is None,
        reason="no mpirun on PATH: the 2-process Trainer runs under mpirun need Open MPI")),
    pytest.param("torchrun", marks=pytest.mark.skipif(
        not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
        reason="torch.distributed has no gloo backend in this torch")),
]
# What an MPI launcher or a torchrun around pytest itself would leave in the environment: a
# torchrun job must see torchrun's variables only.
LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_SIZE", "PMI_RANK",
                      "PMIX_RANK", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                      "MASTER_ADDR", "MASTER_PORT")
# How each launcher names itself in the refusal of a job without use_cpu=True.
LAUNCHER_NAMES = {"mpirun": "the MPI launcher", "torchrun": "torchrun"}


def run_trainer_ranks(out, launcher, *args, fail=False, cases=None):
    """Runs hf_trainer_run.py OUT ARGS in RANKS processes under `launcher` ("mpirun",
    "torchrun", or "accelerate": `accelerate launch --multi_gpu`, which starts them through
    torchrun), each with a micro-batch of BATCH / RANKS, meeting on a free port (DeepSpeed's
    default, 29500, may be taken by a job beside this one). Returns each rank's RESULT, by rank,
    or with fail=True the job's output after asserting that it failed. With cases (a list of
    [OUT, ARGS...]) the job trains each case one after another (hf_trainer_run.py --cases) and
    the answer is a list of each case's results by rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    port = str(free_port())
    if launcher == "mpirun":
        env["MASTER_PORT"] = port
        command = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
                   "-np", str(RANKS), sys.executable]
    else:
        env = {k: v for k, v in env.items() if k not in LAUNCHER_VARIABLES}
        if launcher == "accelerate":
            # No accelerate config file of the user's: the flags below are the whole launch.
            env["HF_HOME"] = str(out / "hf_home")
            command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                       "--num_processes", str(RANKS), "--num_machines", "1",
                       "--mixed_precision", "no", "--dynamo_backend", "no",
                       "--main_process_ip", "127.0.0.1", "--main_process_port", port]
        else:
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                       str(RANKS), "--master-addr", "127.0.0.1", "--master-port", port]
    training = [*TRAINING, "--batch", str(BATCH // RANKS)]
    if cases is None:
        script_args, outs = [str(out), *training, *args], [out]
    else:
        cases = [[str(case[0]), *training, *[str(part) for part in case[1:]]] for case in cases]
        (out / "cases.json").write_text(json.dumps(cases))
        script_args, outs = ["--cases", str(out / "cases.json")], [case[0] for case in cases]
    done = subprocess.run([*command, SCRIPT, *script_args], capture_output=True, text=True,
                          env=env, timeout=300 * len(outs))
    if fail:
        assert done.returncode != 0, done.stdout[-2000:]
        return done.stdout + done.stderr
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    every = []
    for case_out in outs:
        results = []
        for rank in range(RANKS):
            with open(os.path.join(case_out, f"result.rank{rank}.json")) as file:
                results.append(json.load(file))
        assert [(r["rank"], r["world_size"]) for r in results] == [
            (r, RANKS) for r in range(RANKS)]
        # Every rank logs the same loss: the mean over the ranks.
        assert all(r == results[0] | {"rank": r["rank"]} for r in results), results
        every.append(results)
    return every[0] if cases is None else every


@pytest.fixture(scope="module", params=LAUNCHERS)
def ranks_job(request, tmp_path_factory):
    """The 2-process trainings under each launcher, in one job: ZeRO-3, parameters and optimizer
    offloaded, evaluated at each save (ROOT/zero3); its resume from its checkpoint at step
    SAVE_STEPS (ROOT/zero3_resumed); ZeRO-2 (ROOT/zero2). Returns the launcher, ROOT and each
    case's results by rank, by case."""
    root = tmp_path_factory.mktemp(f"ranks_{request.param}")
    ds3 = write_config(root / "ds3.json", 3)
    names = ["zero3", "zero3_resumed", "zero2"]
    results = run_trainer_ranks(root, request.param, cases=[
        [root / "zero3", "--ds", ds3, "--eval"],
        [root / "zero3_resumed", "--ds", ds3, "--resume",
         root / "zero3" / f"checkpoint-{SAVE_STEPS}"],
        [root / "zero2", "--ds", write_config(root / "ds2.json", 2)]])
    return request.param, root, dict(zip(names, results))


def test_two_processes_train_as_one_process_on_the_whole_batch(baseline, ranks_job):
    _, root, results = ranks_job
    out, results = root / "zero3", results["zero3"]
    assert_losses_match(results[0], baseline[0])
    expected = baseline[0]["eval_losses"]
    assert [row[0] for row in results[0]["eval_losses"]] == [SAVE_STEPS, STEPS]
    for (step, loss), (_, loss_ref) in zip(results[0]["eval_losses"], expected):
        assert abs(loss - loss_ref) <= LOSS_REL * abs(loss_ref), (step, loss, loss_ref)
    # save_model gathers the sharded parameters of both ranks; rank 0 writes them.
    assert_weights_match(load_file(str(out / "final" / "model.safetensors")), baseline[1])


def test_two_processes_resume_bit_identically(ranks_job):
    _, root, results = ranks_job
    out, uninterrupted = root / "zero3", results["zero3"]
    checkpoint = out / f"checkpoint-{SAVE_STEPS}"
    # Every rank saved its partition and its random state.
    for rank in range(RANKS):
        assert (checkpoint / f"global_step{SAVE_STEPS}" / f"rank{rank}.zinfckpt").is_file()
        assert (checkpoint / f"rng_state_{rank}.pth").is_file()
    resumed = results["zero3_resumed"]
    assert resumed[0]["losses"] == uninterrupted[0]["losses"][SAVE_STEPS:]
    got = load_file(str(root / "zero3_resumed" / "final" / "model.safetensors"))
    expected = load_file(str(out / "final" / "model.safetensors"))
    assert sorted(got) == sorted(expected)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_two_processes_at_zero2_train_and_save_as_one_process(baseline, ranks_job):
    """ZeRO-2: save_model takes the state dict of the parameters every rank holds whole."""
    _, root, results = ranks_job
    assert_losses_match(results["zero2"][0], baseline[0])
    assert_weights_match(load_file(str(root / "zero2" / "final" / "model.safetensors")),
                         baseline[1])


@pytest.mark.skipif(not torch.distributed.is_available()
                    or not torch.distributed.is_gloo_available(),
                    reason="torch.distributed has no gloo backend in this torch")
def test_accelerate_launch_runs_two_processes_as_torchrun_does(baseline, tmp_path):
    """`accelerate launch --multi_gpu` starts the processes through torchrun; the script's
    use_cpu=True keeps them on the CPU."""
    results = run_trainer_ranks(tmp_path, "accelerate", "--ds",
                                write_config(tmp_path / "ds.json", 2))
    assert_losses_match(results[0], baseline[0])


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU Accelerate counts the ranks "
                    "without use_cpu=True")
def test_two_processes_without_use_cpu_are_refused(launcher, tmp_path):
    """Without use_cpu=True on a machine without a GPU, Accelerate sees one process on each rank
    and would give each the whole data."""
    output = run_trainer_ranks(tmp_path, launcher, "--ds", write_config(tmp_path / "ds.json", 2),
                               "--device-default", fail=True)
    assert "NotImplementedError" in output, output[-3000:]
    assert (f"Accelerate counts 1 process(es) but {LAUNCHER_NAMES[launcher]} started 2"
            in output), output[-3000:]
    assert "use_cpu=True" in output


def test_several_processes_without_a_launcher_are_refused(tmp_path):
    """WORLD_SIZE > 1 without RANK, and no MPI launcher: neither torchrun nor mpirun started
    the process, so no rank is known. The
    refusal comes from install(), before Accelerate would wait for the other ranks of
    torch.distributed's group at TrainingArguments."""
    stderr = run_trainer(tmp_path, "--ds", write_config(tmp_path / "ds.json", 2), fail=True,
                         env={"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                              "MASTER_PORT": str(free_port())},
                         timeout=120)
    assert "NotImplementedError" in stderr and "WORLD_SIZE=2 without RANK" in stderr
    assert "torchrun --nproc-per-node N" in stderr and "mpirun -np N" in stderr
