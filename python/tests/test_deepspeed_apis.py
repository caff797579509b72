"""DeepSpeed APIs a ported script calls beyond the training step, over zinf.deepspeed_compat:
deepspeed.utils' safe_get_full_fp32_param / safe_set_full_fp32_param /
safe_get_full_optimizer_state (and the gradient ones, refused), RepeatingLoader and
engine.training_dataloader, deepspeed.comm's reduce, all_gather_into_tensor,
reduce_scatter_tensor, get_global_rank, new_group and send/recv, get_global_grad_norm() after an
fp16 overflow, and the zero_to_fp32.py script written into each checkpoint directory. Each is
checked against plain torch (the same model trained in one process, torch.optim.AdamW's state,
torch.distributed's semantics) or the files on disk, with DeepSpeed's behaviour
(deepspeed/utils/tensor_fragment.py, runtime/dataloader.py, comm/comm.py, runtime/engine.py and
zero/stage_1_and_2.py / stage3.py, utils/zero_to_fp32.py) written out in the test."""
import gc
import json
import os
import runpy
import stat
import subprocess
import sys
import tempfile
import warnings

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

import zinf.deepspeed_compat as compat
import zinf.zero_to_fp32 as _zero_to_fp32
from _helpers import ds_initialize, torchrun, why_torchrun_unavailable
from conftest import (BETAS, CLIP, EPS, LR, WEIGHT_DECAY, make_mlp, mlp_batches, mlp_config,
                      mlp_loss)

STEPS = 3


def relative_error(got, expected):
    return ((got - expected).norm() / expected.norm()).item()


def torch_run(model, batches, optimizer=None):
    """Plain torch's loop (AdamW, the norm clipped to CLIP): returns the optimizer."""
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                      weight_decay=WEIGHT_DECAY)
    for batch in batches:
        mlp_loss(model, batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


def zinf_run(engine, batches):
    for batch in batches:
        engine.backward(mlp_loss(engine, batch))
        engine.step()


def assert_state_matches(engine_model, reference, optimizer, rel=1e-5):
    """Every parameter's safe_get_full_* answers against torch's parameter and AdamW state."""
    for (name, param), expected in zip(engine_model.named_parameters(), reference.parameters()):
        master = compat.safe_get_full_fp32_param(param)
        assert master.dtype == torch.float32 and master.shape == expected.shape, name
        assert relative_error(master, expected.detach()) < rel, name
        for key in ("exp_avg", "exp_avg_sq"):
            got = compat.safe_get_full_optimizer_state(param, key)
            assert got.shape == expected.shape, (name, key)
            error = relative_error(got, optimizer.state[expected][key])
            assert error < rel, f"{name} {key}: relative error {error:.2e}"


@pytest.mark.parametrize("stage,offload", [(1, "none"), (2, "cpu"), (3, "cpu")])
def test_full_fp32_param_and_optimizer_state_are_torchs(stage, offload):
    batches = mlp_batches(STEPS)
    reference = make_mlp()
    optimizer = torch_run(reference, batches)
    model = make_mlp()
    engine, _, _, _ = ds_initialize(model=model, config=mlp_config(stage, offload))
    try:
        zinf_run(engine, batches)
        assert_state_matches(model, reference, optimizer)
        # DeepSpeed's key check: a state the optimizer does not have is a ValueError.
        with pytest.raises(ValueError, match="momentum_buffer not found in optimizer state"):
            compat.safe_get_full_optimizer_state(model[0].weight, "momentum_buffer")
        # Read again after a step: the state saved for the previous step is not reused.
        extra = mlp_batches(1, seed=13)
        torch_run(reference, extra, optimizer)
        zinf_run(engine, extra)
        assert_state_matches(model, reference, optimizer)
    finally:
        engine.destroy()


def test_optimizer_state_while_the_step_runs_beside_the_backward_is_refused():
    """Where nothing global decides the step first (fp32 or bf16, no gradient_clipping) at stage
    2 or 3 with offload_optimizer cpu, the engine opens the step's optimizer pass during its
    last backward (zinf.overlap_step, docs/ENGINE.md "Updates during the backward"): between that
    backward and step() the moments are being updated, and safe_get_full_optimizer_state is
    refused naming step(); after step() it reads the step's moments, torch.optim.AdamW's
    without clipping. With gradient_clipping the pass waits for step(), and a read between gives
    the last step's moments."""
    batches = mlp_batches(STEPS)
    reference = make_mlp()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                  weight_decay=WEIGHT_DECAY)
    for batch in batches:
        mlp_loss(reference, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    for clip in (False, True):
        model = make_mlp()
        config = mlp_config(2, "cpu")
        if not clip:
            del config["gradient_clipping"]
        engine, _, _, _ = ds_initialize(model=model, config=config)
        try:
            zinf_run(engine, batches[:-1])
            before = compat.safe_get_full_optimizer_state(model[0].weight, "exp_avg")
            engine.backward(mlp_loss(engine, batches[-1]))
            if clip:
                assert torch.equal(
                    compat.safe_get_full_optimizer_state(model[0].weight, "exp_avg"), before)
            else:
                with pytest.raises(RuntimeError, match=r"failed_precondition: the optimizer step "
                                   r"3 is updating the state beside the backward .*call step\(\) "
                                   "first"):
                    compat.safe_get_full_optimizer_state(model[0].weight, "exp_avg")
            engine.step()
            if not clip:
                assert_state_matches(model, reference, optimizer)
        finally:
            engine.destroy()


def test_safe_set_full_fp32_param_trains_on_from_the_new_values():
    # DeepSpeed's safe_set_full_fp32_param replaces the fp32 master and leaves the moments: the
    # reference sets the torch parameter in place between steps and keeps AdamW's state.
    batches = mlp_batches(4)
    generator = torch.Generator().manual_seed(21)
    new_weight = torch.randn(16, 6, generator=generator)
    reference = make_mlp()
    optimizer = torch_run(reference, batches[:2])
    with torch.no_grad():
        reference[0].weight.copy_(new_weight)
    torch_run(reference, batches[2:], optimizer)
    for stage in (2, 3):
        model = make_mlp()
        engine, _, _, _ = ds_initialize(model=model, config=mlp_config(stage))
        try:
            zinf_run(engine, batches[:2])
            compat.safe_set_full_fp32_param(model[0].weight, new_weight.to(torch.float16))
            assert torch.equal(compat.safe_get_full_fp32_param(model[0].weight),
                               new_weight.to(torch.float16).float())
            compat.safe_set_full_fp32_param(model[0].weight, new_weight)
            assert torch.equal(compat.safe_get_full_fp32_param(model[0].weight), new_weight)
            zinf_run(engine, batches[2:])
            assert_state_matches(model, reference, optimizer)
        finally:
            engine.destroy()


@pytest.mark.parametrize("stage", [1, 2])
def test_safe_set_full_fp32_param_puts_a_repointed_view_back_on_the_engine(stage):
    # "The model's copy follows": at stages 1 and 2 the parameter is a view of the engine's full
    # device copy. One whose .data the script pointed at a tensor of its own is put back on that
    # copy, which holds the new values.
    generator = torch.Generator().manual_seed(22)
    new_weight = torch.randn(16, 6, generator=generator)
    model = make_mlp()
    engine, _, _, _ = ds_initialize(model=model, config=mlp_config(stage))
    try:
        zinf_run(engine, mlp_batches(1))
        param = model[0].weight
        engine_ptr = param.data_ptr()
        param.data = torch.randn(16, 6, generator=generator).to(param.dtype)
        compat.safe_set_full_fp32_param(param, new_weight)
        assert param.data_ptr() == engine_ptr
        assert torch.equal(param.detach().float(), new_weight.to(param.dtype).float())
    finally:
        engine.destroy()


def test_gradients_are_refused_and_untrained_tensors_have_no_state():
    model = make_mlp()
    model[3].weight.requires_grad_(False)  # the LayerNorm's weight: frozen
    engine, _, _, _ = ds_initialize(model=model, config=mlp_config(2))
    try:
        batch = mlp_batches(1)[0]
        engine.backward(mlp_loss(engine, batch))
        # zinf keeps no full gradient: refused, naming what to use instead.
        with pytest.raises(NotImplementedError, match="get_global_grad_norm.*register_hook"):
            compat.safe_get_full_grad(model[0].weight)
        with pytest.raises(NotImplementedError, match="register_hook"):
            compat.safe_set_full_grad(model[0].weight, torch.zeros(16, 6))
        # Between a backward and its step the state is the last step's: none yet, zeros.
        assert torch.equal(compat.safe_get_full_optimizer_state(model[0].weight, "exp_avg"),
                           torch.zeros(16, 6))
        before = compat.safe_get_full_fp32_param(model[0].weight)
        with pytest.raises(RuntimeError, match="after engine.step"):
            compat.safe_set_full_fp32_param(model[0].weight, torch.randn(16, 6))
        assert torch.equal(compat.safe_get_full_fp32_param(model[0].weight), before)
        engine.step()
        # A frozen parameter and a tensor of no engine have no master, state or gradient in
        # DeepSpeed's optimizer: None, as its functions answer without the parameter's mapping.
        stranger = torch.nn.Parameter(torch.ones(3))
        for tensor in (model[3].weight, stranger):
            assert compat.safe_get_full_fp32_param(tensor) is None
            assert compat.safe_get_full_optimizer_state(tensor, "exp_avg") is None
            assert compat.safe_get_full_grad(tensor) is None
        with pytest.raises(NotImplementedError, match="load_checkpoint"):
            compat.safe_set_full_optimizer_state(model[0].weight, torch.zeros(16, 6), "exp_avg")
    finally:
        engine.destroy()
    for name in ("safe_get_full_fp32_param", "safe_get_full_grad",
                 "safe_get_full_optimizer_state", "safe_set_full_fp32_param", "RepeatingLoader"):
        assert compat._MODULES["deepspeed.utils"][name] is getattr(compat, name)
    assert compat._MODULES["deepspeed.runtime.dataloader"]["RepeatingLoader"] is \
        compat.RepeatingLoader


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


def test_global_grad_norm_after_an_overflow_is_the_last_applied_steps():
    # DeepSpeed's ZeRO optimizers return from step() on an overflow before computing the norm,
    # so _global_grad_norm keeps the last applied step's (0.0 before any), which the engine's
    # get_global_grad_norm() returns (None before the first step).
    config = mlp_config(2)
    config["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    model = make_mlp()
    engine, _, _, _ = ds_initialize(model=model, config=config)
    batches = [(x.half(), y.half()) for x, y in mlp_batches(3)]
    try:
        assert engine.get_global_grad_norm() is None
        engine.backward(mlp_loss(engine, batches[0]).float() * float("inf"))
        engine.step()
        assert not engine.was_step_applied()
        assert engine.get_global_grad_norm() == 0.0
        # The norm of an applied step: torch's norm of the fp32 gradients (fp16 compute, so to
        # fp16's precision), taken from the engine's fp16 values of the parameters.
        reference = make_mlp()
        with torch.no_grad():
            for (name, mine), (_, theirs) in zip(model.named_parameters(),
                                                 reference.named_parameters()):
                theirs.copy_(compat.safe_get_full_fp32_param(mine).half().float())
        x, y = batches[1]
        mlp_loss(reference, (x.float(), y.float())).backward()
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf")).item()
        engine.backward(mlp_loss(engine, batches[1]).float())
        engine.step()
        assert engine.was_step_applied()
        applied = engine.get_global_grad_norm()
        assert applied == pytest.approx(expected, rel=2e-2)
        engine.backward(mlp_loss(engine, batches[2]).float() * float("inf"))
        engine.step()
        assert not engine.was_step_applied() and engine.skipped_steps == 2
        assert engine.get_global_grad_norm() == applied
    finally:
        engine.destroy()


def run_script_in_this_process(save_dir, monkeypatch, *argv):
    """`python zero_to_fp32.py ARGV` in save_dir, the file there run as __main__ in this process
    (runpy) with that directory as the working directory and ARGV as sys.argv: the command line
    each test also runs once in a fresh process, without another process's start."""
    with monkeypatch.context() as patched:
        patched.chdir(save_dir)
        patched.setattr(sys, "argv", ["zero_to_fp32.py", *argv])
        with pytest.raises(SystemExit) as exited:
            runpy.run_path("zero_to_fp32.py", run_name="__main__")
    assert exited.value.code == 0


@pytest.mark.parametrize("safe", [False, True])
def test_zero_to_fp32_script_in_the_checkpoint_directory(tmp_path, safe, monkeypatch):
    if safe:
        pytest.importorskip("safetensors", reason="safetensors is not installed")
    batches = mlp_batches(STEPS)
    reference = make_mlp()
    optimizer = torch_run(reference, batches[:2])
    early = {name: p.detach().clone() for name, p in reference.named_parameters()}
    torch_run(reference, batches[2:], optimizer)
    model = make_mlp()
    engine, _, _, _ = ds_initialize(model=model, config=mlp_config(3))
    save_dir = tmp_path / "ckpt"
    try:
        zinf_run(engine, batches[:2])
        engine.save_checkpoint(str(save_dir), tag="early")
        zinf_run(engine, batches[2:])
        engine.save_checkpoint(str(save_dir))
    finally:
        engine.destroy()
    # As DeepSpeed's engine does: rank 0 writes the script into the directory, executable.
    script = save_dir / "zero_to_fp32.py"
    assert script.is_file() and script.stat().st_mode & stat.S_IXUSR
    assert not [p for p in os.listdir(save_dir) if p.endswith(".tmp")]
    # DeepSpeed's command line, run where it lies: `python zero_to_fp32.py . out_dir`, with -t
    # for a tag other than latest's.
    options = ["--safe_serialization"] if safe else []
    done = subprocess.run([sys.executable, "zero_to_fp32.py", ".", "out", "-t", "early",
                           *options], cwd=save_dir, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    name = "model.safetensors" if safe else "pytorch_model.bin"

    def read(path):
        if safe:
            from safetensors.torch import load_file
            return load_file(path)
        return torch.load(path)

    def assert_weights(weights, expected):
        assert sorted(weights) == sorted(expected)
        for key, values in expected.items():
            assert weights[key].dtype == torch.float32
            error = relative_error(weights[key], values)
            assert error < 1e-5, f"{key}: relative error {error:.2e}"

    assert_weights(read(save_dir / "out" / name), early)
    # Without -t: the tag `latest` names, the last save's.
    run_script_in_this_process(save_dir, monkeypatch, ".", "last", *options)
    assert_weights(read(save_dir / "last" / name),
                   {n: p.detach() for n, p in reference.named_parameters()})
    # Weights over --max_shard_size go into shards named as DeepSpeed's script (Hugging Face's
    # split) names them, each at most that size unless one weight is larger, and an index that
    # maps every name to its file; 0.5KB is a size as DeepSpeed reads it (500 bytes). The
    # script's main() in this process, to spare the subprocesses' start.
    last = {n: p.detach() for n, p in reference.named_parameters()}
    assert _zero_to_fp32.main([str(save_dir), str(save_dir / "small"), "--max_shard_size",
                               "0.5KB", *options]) == 0
    with open(save_dir / "small" / f"{name}.index.json") as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    stem, extension = name.split(".")
    assert len(files) > 1
    assert files == [f"{stem}-{i:05d}-of-{len(files):05d}.{extension}"
                     for i in range(1, len(files) + 1)]
    assert sorted(os.listdir(save_dir / "small")) == sorted(files + [f"{name}.index.json"])
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in last.values())
    merged = {}
    for file in files:
        part = read(save_dir / "small" / file)
        assert len(part) == 1 or sum(v.numel() * 4 for v in part.values()) <= 500, file
        assert all(index["weight_map"][key] == file for key in part)
        merged.update(part)
    assert_weights(merged, last)
    # "5G" is 5 GB (DeepSpeed's huggingface_hub reads GB; the letter alone is read too): one
    # file, no index.
    assert _zero_to_fp32.main([str(save_dir), str(save_dir / "whole"), "--max_shard_size", "5G",
                               *options]) == 0
    assert os.listdir(save_dir / "whole") == [name]
    # A size that is not one is refused before any work, naming it.
    with pytest.raises(ValueError, match="--max_shard_size '5XB': a number of bytes"):
        _zero_to_fp32.main([str(save_dir), str(save_dir / "bad"), "--max_shard_size", "5XB"])
    assert not (save_dir / "bad").exists()


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_to_fp32_excludes_frozen_parameters_at_every_stage(tmp_path, stage, monkeypatch):
    """DeepSpeed's --exclude_frozen_parameters (and the functions' exclude_frozen_parameters=)
    leaves out every parameter with requires_grad False, at every stage: at stages 1 and 2 zinf
    keeps them in the client state, which is then only mapped (its buffers are read), at stage 3
    the engine holds them and the manifest marks them. lazy_mode=True gives, as DeepSpeed's,
    weights that read themselves on .contiguous()."""
    model = make_mlp()
    model[3].weight.requires_grad_(False)
    frozen = model[3].weight.detach().clone()
    engine, _, _, _ = ds_initialize(model=model, config=mlp_config(stage))
    save_dir = tmp_path / "ckpt"
    try:
        zinf_run(engine, mlp_batches(2))
        masters = {n: compat.safe_get_full_fp32_param(p) for n, p in model.named_parameters()
                   if p.requires_grad}
        engine.save_checkpoint(str(save_dir))
    finally:
        engine.destroy()
    trainable = sorted(masters)
    assert "3.weight" not in trainable
    for exclude in (False, True):
        out = f"out{int(exclude)}"
        if exclude:  # in a fresh process, as a user runs it
            done = subprocess.run([sys.executable, "zero_to_fp32.py", ".", out,
                                   "--exclude_frozen_parameters"],
                                  cwd=save_dir, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr[-3000:]
        else:
            run_script_in_this_process(save_dir, monkeypatch, ".", out)
        weights = torch.load(save_dir / out / "pytorch_model.bin")
        assert sorted(weights) == (trainable if exclude else sorted(trainable + ["3.weight"]))
        for key, values in masters.items():
            assert torch.equal(weights[key], values), key
        if not exclude:
            assert torch.equal(weights["3.weight"], frozen)
    from zinf.torch import get_fp32_state_dict_from_zero_checkpoint
    loaded = []
    load = torch.load
    monkeypatch.setattr(torch, "load", lambda f, *a, **k: loaded.append((str(f), k.get("mmap")))
                        or load(f, *a, **k))
    plain = get_fp32_state_dict_from_zero_checkpoint(str(save_dir), exclude_frozen_parameters=True)
    monkeypatch.undo()
    assert sorted(plain) == trainable
    # The client state was read, and mapped: an all() over no loads would pass as well.
    client_loads = [mmap for path, mmap in loaded if path.endswith("client_state.bin")]
    assert client_loads and all(client_loads), loaded
    # The lazy weights' temporary file lies in a directory of this test's own.
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    lazy = get_fp32_state_dict_from_zero_checkpoint(str(save_dir), lazy_mode=True)
    assert sorted(lazy) == sorted(trainable + ["3.weight"])
    assert lazy["3.weight"].shape == frozen.shape and lazy["3.weight"].dtype == torch.float32
    assert torch.equal(lazy["3.weight"].contiguous(), frozen)
    for key, values in masters.items():
        assert torch.equal(lazy[key].contiguous(), values), key
    assert len(os.listdir(scratch)) == 1
    # The last weight gone, the directory is removed, and without the ResourceWarning
    # ("Implicitly cleaning up") of a TemporaryDirectory left to its own finalizer.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del lazy
        gc.collect()
    assert os.listdir(scratch) == []
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], \
        [str(w.message) for w in caught]


# ---- two ranks under torchrun ------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    if why_torchrun_unavailable() is not None:
        pytest.skip(why_torchrun_unavailable())
    out = tmp_path_factory.mktemp("deepspeed_apis")
    done = torchrun("deepspeed_apis_run.py", [out], timeout=300)
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


def test_full_state_at_stage_3_on_two_ranks_is_torchs_on_the_full_batch(two_rank_run):
    from deepspeed_apis_run import STEPS as RUN_STEPS

    reference = make_mlp()
    optimizer = torch_run(reference, mlp_batches(RUN_STEPS))
    states = [torch.load(two_rank_run / f"state.rank{rank}.pt") for rank in range(2)]
    for name, expected in reference.named_parameters():
        # Every rank gets the whole tensor, the same bits on both.
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            assert torch.equal(states[0][name][key], states[1][name][key]), (name, key)
        assert relative_error(states[0][name]["fp32"], expected.detach()) < 1e-5, name
        for key in ("exp_avg", "exp_avg_sq"):
            error = relative_error(states[0][name][key], optimizer.state[expected][key])
            assert error < 1e-5, f"{name} {key}: relative error {error:.2e}"


def test_srun_with_pmix_is_an_mpi_launcher(monkeypatch):
    """srun --mpi=pmix sets PMIX_RANK and Slurm's task counts, and no OMPI_COMM_WORLD_* or PMI_*:
    deepspeed_compat reads its ranks from them, as zinf.torch picks its MPI communicator there,
    and sets the torch.distributed environment from them; MASTER_ADDR must be given when the
    tasks span several nodes."""
    for key in list(os.environ):
        if key.startswith(("OMPI_", "PMI_", "PMIX_", "SLURM_", "MPI_LOCAL", "TORCHELASTIC_")):
            monkeypatch.delenv(key)
    # Set by the code under test: each recorded (set, then removed) so that the test's end
    # restores it as it was.
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT"):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    # 8 tasks: 2 on each of nodes 0-2, 2 on node 3; this one the second task of node 1.
    monkeypatch.setenv("PMIX_RANK", "3")
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "8")
    monkeypatch.setenv("SLURM_STEP_NUM_NODES", "4")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "2(x3),2")
    monkeypatch.setenv("SLURM_NODEID", "1")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    assert compat._mpi_launcher() == (3, 8, 1, 2)
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        compat._launcher_environment("deepspeed.init_distributed")
    monkeypatch.setenv("MASTER_ADDR", "node0")
    assert compat._launcher_environment("deepspeed.init_distributed") == (3, 8, 1)
    assert [os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")] == [
        "3", "8", "1", "2"]
    # One node of 2 tasks: every task here, so the rendezvous is this machine's.
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("PMIX_RANK", "1")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    monkeypatch.setenv("SLURM_STEP_NUM_NODES", "1")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "2")
    monkeypatch.setenv("SLURM_NODEID", "0")
    assert compat._launcher_environment("deepspeed.init_distributed") == (1, 2, 1)
    assert os.environ["MASTER_ADDR"] == "127.0.0.1"
    # The batch script's own shell has Slurm's variables but no PMIX_RANK: one process.
    monkeypatch.delenv("PMIX_RANK")
    assert compat._mpi_launcher() is None


def test_torchrun_under_srun_is_torchruns(monkeypatch):
    """`srun --mpi=pmix torchrun --nproc-per-node 4 ...` on 2 nodes: each torchrun is one srun
    task (PMIX_RANK the node's index, SLURM_STEP_NUM_TASKS the node count), and its workers
    inherit those variables beside the RANK and WORLD_SIZE torchrun gives them. torchrun's word
    wins (its agent sets TORCHELASTIC_RUN_ID for every worker), in deepspeed_compat's launcher
    and in zinf.torch's choice of communicator; without TORCHELASTIC_RUN_ID (RANK set by other
    means), srun's ranks are the launcher's and the mismatch is refused."""
    for key in list(os.environ):
        if key.startswith(("OMPI_", "PMI_", "PMIX_", "SLURM_", "MPI_LOCAL", "TORCHELASTIC_")):
            monkeypatch.delenv(key)
    # Worker 1 of node 1 (rank 5 of 8), as torch.distributed.run's agent sets it.
    for key, value in (("PMIX_RANK", "1"), ("SLURM_PROCID", "1"), ("SLURM_STEP_NUM_TASKS", "2"),
                       ("SLURM_STEP_NUM_NODES", "2"), ("SLURM_STEP_TASKS_PER_NODE", "1(x2)"),
                       ("SLURM_NODEID", "1"), ("SLURM_LOCALID", "0"), ("RANK", "5"),
                       ("WORLD_SIZE", "8"), ("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "4"),
                       ("MASTER_ADDR", "node0"), ("MASTER_PORT", "29400"),
                       ("TORCHELASTIC_RUN_ID", "1234")):
        monkeypatch.setenv(key, value)
    assert compat._mpi_launcher() is None
    assert compat._launcher() == ((5, 8, 1, 4), "torchrun")
    assert compat._launcher_environment("deepspeed.init_distributed") == (5, 8, 1)
    assert [os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                    "MASTER_ADDR", "MASTER_PORT")] == [
        "5", "8", "1", "4", "node0", "29400"]
    assert compat._zt._choose_comm(None) == "torch"
    # The same variables without torchrun's: srun's task is the launcher, and RANK=5 disagrees.
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert compat._mpi_launcher() == (1, 2, 0, 1)
    with pytest.raises(ValueError, match="RANK=5 in the environment, but the MPI launcher says 1"):
        compat._launcher_environment("deepspeed.init_distributed")
    assert compat._zt._choose_comm(None) == "mpi"


@pytest.mark.parametrize("zero", [None, {"offload_optimizer": {"device": "cpu"}}])
def test_a_config_without_a_zero_stage_keeps_the_module_whole(zero, tmp_path):
    # DeepSpeed's ZeRO stage where the config names none is 0 (DeepSpeedZeroConfig.stage): no
    # partitioning, so engine.module's parameters stay whole and a DeepSpeed script may save
    # torch.save(engine.module.state_dict()) or read model.parameters() outside the forward.
    # zinf runs it as stage 1, and engine.zero_optimization_stage() is DeepSpeed's answer, 0
    # (it said 1). (It ran stage 3 before: the state dict held empty tensors.)
    config = mlp_config(1)
    if zero is None:
        del config["zero_optimization"]
    else:
        config["zero_optimization"] = zero
    engine, _, _, _ = ds_initialize(model=make_mlp(), config=config,
                                    model_parameters=None)
    assert engine.zero_optimization_stage() == 0 and not engine.zero_optimization()
    assert engine.stage == 1
    reference = make_mlp()
    torch_run(reference, mlp_batches(STEPS))
    zinf_run(engine, mlp_batches(STEPS))
    torch.save(engine.module.state_dict(), tmp_path / "model.pt")
    saved = torch.load(tmp_path / "model.pt")
    expected = reference.state_dict()
    assert saved.keys() == expected.keys()
    for name, value in expected.items():
        assert saved[name].shape == value.shape, name
        assert relative_error(saved[name], value) < 1e-5, name
    engine.destroy()


@pytest.mark.parametrize("zero, asked", [
    ({"offload_param": {"device": "cpu"}}, 'offload_param.device "cpu"'),
    ({"cpu_offload_param": True}, "cpu_offload_param: True")])
def test_a_parameter_offload_without_a_zero_stage_is_refused_asking_for_stage_3(zero, asked):
    # A config asking for a parameter offload and naming no stage ran at zinf's stage 3 before
    # the default became DeepSpeed's 0, where the section asks for nothing; the engine then
    # refused it naming stage 1, which the config does not hold. It is refused naming the key.
    config = mlp_config(1)
    config["zero_optimization"] = zero
    with pytest.raises(ValueError, match=f"zero_optimization.{asked} asks to offload the "
                       "parameters, but the config names no ZeRO stage.*add \"stage\": 3"):
        ds_initialize(model=make_mlp(), config=config, model_parameters=None)
    # Offloading nothing ("none") is no request: stage 0, as without the section.
    config["zero_optimization"] = {"offload_param": {"device": "none"}}
    engine, _, _, _ = ds_initialize(model=make_mlp(), config=config, model_parameters=None)
    assert engine.zero_optimization_stage() == 0
    engine.destroy()


def test_a_second_save_of_a_tag_is_skipped_only_when_nothing_changed(tmp_path):
    # The Trainer saves one checkpoint by two save_checkpoint(output_dir) calls with nothing
    # between, and the second is skipped. A save of the same tag after a change without a step
    # (a GatheredParameters write, a checkpoint load) must write it, as DeepSpeed writes every
    # save: before, it was skipped and the checkpoint kept the old weights.
    engine, _, _, _ = ds_initialize(model=make_mlp(), config=mlp_config(2))
    zinf_run(engine, mlp_batches(1))
    other = tmp_path / "other"
    engine.save_checkpoint(str(other), tag="t")
    saved = tmp_path / "saved"
    manifest = saved / "final" / "manifest.json"
    engine.save_checkpoint(str(saved), tag="final")
    first = os.stat(manifest).st_ino
    engine.save_checkpoint(str(saved), tag="final")
    assert os.stat(manifest).st_ino == first  # nothing changed: skipped
    weight = engine.module[0].weight
    value = torch.linspace(-1, 1, weight.numel()).reshape(weight.shape)
    with compat._zt.GatheredParameters([weight], modifier_rank=0):
        weight.data.copy_(value)
    engine.save_checkpoint(str(saved), tag="final")
    written = compat._zt.get_fp32_state_dict_from_zero_checkpoint(str(saved), tag="final")
    assert torch.equal(written["0.weight"], value)
    # A checkpoint load between: its weights are saved.
    engine.load_checkpoint(str(other), tag="t")
    engine.save_checkpoint(str(saved), tag="final")
    written = compat._zt.get_fp32_state_dict_from_zero_checkpoint(str(saved), tag="final")
    loaded = compat._zt.get_fp32_state_dict_from_zero_checkpoint(str(other), tag="t")
    assert torch.equal(written["0.weight"], loaded["0.weight"])
    engine.destroy()
