"""DeepSpeed's monitors over zinf.deepspeed_compat: the config's csv_monitor and tensorboard
sections and engine.monitor, and deepspeed.runtime.utils.see_memory_usage.

What DeepSpeed writes (deepspeed/runtime/engine.py, monitor/csv_monitor.py, tensorboard.py):
rank 0 alone; "Train/Samples/train_loss" in the backward of the micro-batch that ends a gradient
accumulation, the sum over the step's micro-batches of loss / gradient_accumulation_steps (their
mean), at the samples of the steps before it; "Train/Samples/lr" (the first group's lr after the
step, the next step's) and with fp16 "Train/Samples/loss_scale" (the scale after the step) in
engine.step() at that boundary, at the samples counting the step (a step skipped for an overflow
counts). The CSV monitor keeps one file per event in <output_path>/<job_name>/, named after the
event with "/" and " " as "_", headed "step,<last part of the name>", each row "step,value",
written by Python's csv module (lines end in CRLF)."""
import csv
import importlib.machinery
import io
import json
import os
import re
import resource
import sys
import types

import pytest
import torch

import zinf._monitor as _monitor
import zinf.deepspeed_compat as compat
import zinf.torch as _zt
from _helpers import ds_initialize, torchrun, why_torchrun_unavailable
from conftest import make_mlp, mlp_batches, mlp_config, mlp_loss

GAS = 2
STEPS = 4
# A linear warm-up, so that every step's learning rate differs. DeepSpeed's WarmupLR counts
# last_batch_iteration from -1, one more at each applied step, and sets min_lr + (max_lr - min_lr)
# * min(1, last_batch_iteration / warmup_num_steps): after k applied steps, iteration k - 1.
MIN_LR, MAX_LR, WARMUP = 1e-4, 1e-3, 10
SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": MIN_LR, "warmup_max_lr": MAX_LR,
                                            "warmup_num_steps": WARMUP,
                                            "warmup_type": "linear"}}


def monitored_config(out_dir, fp16=False, **sections):
    config = mlp_config(2)
    config["gradient_accumulation_steps"] = GAS
    config["scheduler"] = SCHEDULER
    config["csv_monitor"] = {"enabled": True, "output_path": str(out_dir), "job_name": "run1"}
    if fp16:
        # The scale doubles after 2 good steps in a row and halves at an overflow (hysteresis 1).
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2,
                          "hysteresis": 1}
    config.update(sections)
    return config


def read_csv(path):
    """(the header, [(step, value)]) of a CSV monitor file, checking DeepSpeed's CRLF lines."""
    with open(path, "rb") as f:
        data = f.read()
    text = data.decode()
    assert text.endswith("\r\n") and text.count("\r\n") == text.count("\n"), repr(text)
    rows = list(csv.reader(io.StringIO(text, newline="")))
    return rows[0], [(int(step), float(value)) for step, value in rows[1:]]


def train(engine, scheduler, batches, fp16=False, overflow_at=None):
    """The DeepSpeed loop: forward, backward, step per micro-batch. Returns the losses the
    forward returned (as floats), and after each optimizer step the scheduler's lr and the loss
    scale. overflow_at: the micro-batch whose loss is made infinite (an fp16 overflow)."""
    losses, lrs, scales = [], [], []
    for index, (x, y) in enumerate(batches):
        if fp16:
            x, y = x.half(), y.half()
        loss = mlp_loss(engine, (x, y)).float()
        if index == overflow_at:
            loss = loss * float("inf")
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
        if (index + 1) % GAS == 0:
            lrs.append(scheduler.get_last_lr()[0])
            scales.append(engine.loss_scale)
    return losses, lrs, scales


@pytest.mark.parametrize("fp16", [False, True])
def test_csv_monitor_writes_deepspeeds_files(tmp_path, fp16):
    # With fp16 the third step overflows (its micro-batches' losses infinite): DeepSpeed logs
    # its train_loss (inf), the lr it leaves unchanged and the halved loss scale, and counts its
    # samples.
    overflow_at = 3 * GAS - 1 if fp16 else None
    engine, _, _, scheduler = ds_initialize(model=make_mlp(),
                                            config=monitored_config(tmp_path, fp16))
    try:
        assert engine.monitor.enabled
        losses, lrs, scales = train(engine, scheduler, mlp_batches(STEPS * GAS), fp16,
                                    overflow_at)
        samples = engine.train_batch_size()
        assert samples == 4 * GAS
    finally:
        engine.destroy()
    log_dir = tmp_path / "run1"
    names = {"Train_Samples_train_loss.csv", "Train_Samples_lr.csv"}
    if fp16:
        names.add("Train_Samples_loss_scale.csv")
    assert set(os.listdir(log_dir)) == names

    header, rows = read_csv(log_dir / "Train_Samples_train_loss.csv")
    assert header == ["step", "train_loss"]
    assert [step for step, _ in rows] == [k * samples for k in range(STEPS)]
    for k, (_, value) in enumerate(rows):
        step_losses = losses[k * GAS:(k + 1) * GAS]
        assert value == pytest.approx(sum(step_losses) / GAS, rel=1e-6), k

    # The lr after each step: the scheduler's, and DeepSpeed's WarmupLR formula of the steps
    # applied (the overflowed step applies nothing).
    header, rows = read_csv(log_dir / "Train_Samples_lr.csv")
    assert header == ["step", "lr"]
    assert [step for step, _ in rows] == [k * samples for k in range(1, STEPS + 1)]
    assert [value for _, value in rows] == lrs
    applied = 0
    for k, (_, value) in enumerate(rows, start=1):
        applied += 0 if (fp16 and k == 3) else 1
        expected = MIN_LR + (MAX_LR - MIN_LR) * min(1.0, (applied - 1) / WARMUP)
        assert value == pytest.approx(expected, rel=1e-6), k
    assert len(set(lrs)) == (STEPS - 1 if fp16 else STEPS)

    if fp16:
        header, rows = read_csv(log_dir / "Train_Samples_loss_scale.csv")
        assert header == ["step", "loss_scale"]
        assert [step for step, _ in rows] == [k * samples for k in range(1, STEPS + 1)]
        assert [value for _, value in rows] == scales == [256.0, 512.0, 256.0, 256.0]
        # DeepSpeed's scaler holds the initial scale as an int (2**initial_scale_power) until
        # it first changes it, by a float factor.
        with open(log_dir / "Train_Samples_loss_scale.csv", newline="") as f:
            assert [row[1] for row in csv.reader(f)][1:] == ["256", "512.0", "256.0", "256.0"]


def test_csv_monitor_appends_with_a_header_per_initialize(tmp_path):
    # DeepSpeed opens each file for appending and heads it at its first write in this monitor
    # (one per initialize), so a second engine into the same directory, in the same process,
    # adds a header line and its rows.
    for _ in range(2):
        engine, _, _, scheduler = ds_initialize(model=make_mlp(),
                                                config=monitored_config(tmp_path))
        try:
            train(engine, scheduler, mlp_batches(GAS))
        finally:
            engine.destroy()
    with open(tmp_path / "run1" / "Train_Samples_lr.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert [row[0] for row in rows] == ["step", str(GAS * 4), "step", str(GAS * 4)]


def check_train_loss_rows(log_dir, step_losses, samples):
    """Train_Samples_train_loss.csv holds one row per optimizer step, at the samples of the
    steps before it, with the mean of the step's micro-batch losses; Train_Samples_lr.csv one row
    per step, at the samples counting it."""
    header, rows = read_csv(log_dir / "Train_Samples_train_loss.csv")
    assert header == ["step", "train_loss"]
    assert [step for step, _ in rows] == [k * samples for k in range(len(step_losses))]
    for k, ((_, value), losses) in enumerate(zip(rows, step_losses)):
        assert value == pytest.approx(sum(losses) / len(losses), rel=1e-6), k
    _, rows = read_csv(log_dir / "Train_Samples_lr.csv")
    assert [step for step, _ in rows] == [k * samples for k in range(1, len(step_losses) + 1)]


def test_train_loss_with_every_backward_before_one_step(tmp_path):
    # zinf's engine takes the optimizer step at the step() after gradient_accumulation_steps
    # backward passes however they are interleaved with step() calls: the loss is written in
    # the backward that completes the accumulation.
    engine, _, _, _ = ds_initialize(model=make_mlp(), config=monitored_config(tmp_path))
    losses = []
    try:
        batches = mlp_batches(STEPS * GAS)
        for k in range(STEPS):
            for batch in batches[k * GAS:(k + 1) * GAS]:
                loss = mlp_loss(engine, batch)
                losses.append(loss.item())
                engine.backward(loss)
            engine.step()
        assert engine.global_steps == STEPS
        samples = engine.train_batch_size()
    finally:
        engine.destroy()
    check_train_loss_rows(tmp_path / "run1",
                          [losses[k * GAS:(k + 1) * GAS] for k in range(STEPS)], samples)


def test_train_loss_on_the_trainers_path_with_a_partial_last_accumulation(tmp_path):
    # The Trainer under Accelerate: the boundary set before each backward, the loss divided by
    # the micro-batches of its accumulation (fewer in the last one), backward with
    # scale_wrt_gas=False, then step() after every micro-batch. DeepSpeed sums the losses as
    # given, so each row is the accumulation's mean.
    engine, _, _, _ = ds_initialize(model=make_mlp(), config=monitored_config(tmp_path))
    groups = [[0, 1], [2, 3], [4]]
    batches = mlp_batches(5)
    losses = []
    try:
        for group in groups:
            for position, index in enumerate(group):
                engine.set_gradient_accumulation_boundary(position == len(group) - 1)
                loss = mlp_loss(engine, batches[index])
                losses.append(loss.item())
                engine.backward(loss / len(group), scale_wrt_gas=False)
                engine.step()
        assert engine.global_steps == len(groups)
        samples = engine.train_batch_size()
    finally:
        engine.destroy()
    check_train_loss_rows(tmp_path / "run1", [[losses[i] for i in group] for group in groups],
                          samples)


def test_train_loss_without_gradient_accumulation(tmp_path):
    config = monitored_config(tmp_path)
    config["gradient_accumulation_steps"] = 1
    engine, _, _, _ = ds_initialize(model=make_mlp(), config=config)
    losses = []
    try:
        for batch in mlp_batches(3):
            loss = mlp_loss(engine, batch)
            losses.append(loss.item())
            engine.backward(loss)
            engine.step()
        samples = engine.train_batch_size()
        assert samples == 4
    finally:
        engine.destroy()
    check_train_loss_rows(tmp_path / "run1", [[loss] for loss in losses], samples)


def test_monitor_write_events_adds_a_scripts_events(tmp_path):
    config = mlp_config(1)
    config["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path)}
    engine, _, _, _ = ds_initialize(model=make_mlp(), config=config)
    try:
        assert engine.monitor.enabled
        engine.monitor.write_events([("Eval/accuracy of model", 0.25, 7),
                                     ("Eval/accuracy of model", 0.5, 9), ("tokens", 1234, 9)])
    finally:
        engine.destroy()
    # job_name defaults to DeepSpeed's "DeepSpeedJobName".
    log_dir = tmp_path / "DeepSpeedJobName"
    assert sorted(os.listdir(log_dir)) == ["Eval_accuracy_of_model.csv", "tokens.csv"]
    assert read_csv(log_dir / "Eval_accuracy_of_model.csv") == (["step", "accuracy of model"],
                                                               [(7, 0.25), (9, 0.5)])
    assert read_csv(log_dir / "tokens.csv") == (["step", "tokens"], [(9, 1234.0)])


def test_without_a_monitor_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = mlp_config(1)
    config["csv_monitor"] = {"enabled": False, "output_path": "logs"}
    engine, _, _, _ = ds_initialize(model=make_mlp(), config=config)
    try:
        assert not engine.monitor.enabled
        for batch in mlp_batches(2):
            engine.backward(mlp_loss(engine, batch))
            engine.step()
        engine.monitor.write_events([("custom", 1.0, 1)])
    finally:
        engine.destroy()
    assert os.listdir(tmp_path) == []


def test_tensorboard_without_its_package_is_refused_naming_the_key(tmp_path, monkeypatch):
    # DeepSpeed raises the package's ImportError there (check_tb_availability); zinf says which
    # key asked for it, before the engine is built, and creates no directory.
    real_find_spec = _monitor.importlib.util.find_spec
    monkeypatch.setattr(_monitor.importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real_find_spec(name,
                                                                                          *a))
    config = mlp_config(1)
    config["tensorboard"] = {"enabled": True, "output_path": str(tmp_path / "tb")}
    with pytest.raises(ImportError, match=r'"tensorboard.enabled".*pip install tensorboard'):
        ds_initialize(model=make_mlp(), config=config)
    assert not (tmp_path / "tb").exists()


def test_tensorboard_writes_deepspeeds_scalars(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed (zinf "
                                              "does not depend on it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = monitored_config(tmp_path, tensorboard={"enabled": True,
                                                     "output_path": str(tmp_path / "tb"),
                                                     "job_name": "tbrun"})
    engine, _, _, scheduler = ds_initialize(model=make_mlp(), config=config)
    try:
        losses, lrs, _ = train(engine, scheduler, mlp_batches(STEPS * GAS))
        engine.monitor.write_events([("Custom/value", 2.5, 3)])
        samples = engine.train_batch_size()
    finally:
        engine.destroy()
    events = EventAccumulator(str(tmp_path / "tb" / "tbrun"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"Train/Samples/train_loss", "Train/Samples/lr",
                                            "Custom/value"}
    train_loss = events.Scalars("Train/Samples/train_loss")
    assert [e.step for e in train_loss] == [k * samples for k in range(STEPS)]
    for k, event in enumerate(train_loss):
        assert event.value == pytest.approx(sum(losses[k * GAS:(k + 1) * GAS]) / GAS, rel=1e-6)
    lr = events.Scalars("Train/Samples/lr")
    assert [e.step for e in lr] == [k * samples for k in range(1, STEPS + 1)]
    assert [e.value for e in lr] == pytest.approx(lrs, rel=1e-6)
    assert [(e.step, e.value) for e in events.Scalars("Custom/value")] == [(3, 2.5)]


@pytest.mark.parametrize("key", ["wandb", "comet"])
def test_wandb_and_comet_warn_that_zinf_does_not_log_to_them(key):
    config = mlp_config(1)
    config[key] = {"enabled": True}
    with pytest.warns(UserWarning, match=rf'"{key}.enabled": zinf.deepspeed_compat does not '):
        engine, _, _, _ = ds_initialize(model=make_mlp(), config=config)
    try:
        assert not engine.monitor.enabled
    finally:
        engine.destroy()


@pytest.mark.parametrize("key,section,message", [
    ("csv_monitor", {"enabled": "yes"}, r'"csv_monitor.enabled": expected true or false'),
    ("csv_monitor", {"enabled": True, "output_path": 3},
     r'"csv_monitor.output_path": expected a string'),
    ("csv_monitor", [], r'"csv_monitor": expected an object'),
    # DeepSpeed's config models forbid keys they do not define.
    ("csv_monitor", {"enabled": True, "outputpath": "logs"},
     r'"csv_monitor.outputpath": not a key of this section \(enabled, output_path, job_name\)'),
    ("tensorboard", {"enabled": False, "log_dir": "logs"},
     r'"tensorboard.log_dir": not a key of this section'),
])
def test_a_malformed_monitor_section_is_refused_naming_the_key(key, section, message):
    config = mlp_config(1)
    config[key] = section
    with pytest.raises(ValueError, match=message):
        ds_initialize(model=make_mlp(), config=config)


def test_auto_in_a_monitor_section_is_the_default(tmp_path, monkeypatch):
    # DeepSpeed's config models drop a key set to "auto" (the Trainer's placeholder), leaving
    # its default: job_name "auto" writes to DeepSpeedJobName, enabled "auto" is false, and a
    # section "auto" is no section.
    monkeypatch.chdir(tmp_path)
    config = mlp_config(1)
    config["csv_monitor"] = {"enabled": True, "output_path": "logs", "job_name": "auto"}
    config["tensorboard"] = {"enabled": "auto", "output_path": "tb"}
    config["wandb"] = "auto"
    engine, _, _, _ = ds_initialize(model=make_mlp(), config=config)
    try:
        assert engine.monitor.enabled
        assert engine.monitor.tb_monitor is None
        engine.monitor.write_events([("custom", 1.5, 2)])
    finally:
        engine.destroy()
    assert os.listdir(tmp_path) == ["logs"]
    assert os.listdir(tmp_path / "logs") == ["DeepSpeedJobName"]
    assert read_csv(tmp_path / "logs" / "DeepSpeedJobName" / "custom.csv") == (
        ["step", "custom"], [(2, 1.5)])


class FakeSummaryWriter:
    """torch.utils.tensorboard.SummaryWriter as the tensorboard monitor uses it, recording the
    calls (the tensorboard package is optional)."""
    made = []

    def __init__(self, log_dir):
        self.log_dir = log_dir
        self.scalars = []
        self.flushes = 0
        self.closed = False
        FakeSummaryWriter.made.append(self)

    def add_scalar(self, name, value, step):
        assert not self.closed
        self.scalars.append((name, value, step))

    def flush(self):
        self.flushes += 1

    def close(self):
        self.closed = True


@pytest.fixture
def fake_tensorboard(monkeypatch):
    real_find_spec = _monitor.importlib.util.find_spec
    monkeypatch.setattr(
        _monitor.importlib.util, "find_spec",
        lambda name, *a: (importlib.machinery.ModuleSpec("tensorboard", None)
                          if name == "tensorboard" else real_find_spec(name, *a)))
    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = FakeSummaryWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    FakeSummaryWriter.made.clear()
    return FakeSummaryWriter.made


def test_destroy_closes_the_tensorboard_writer(tmp_path, fake_tensorboard):
    # SummaryWriter runs a thread of its own until close(): each engine's would outlive it.
    config = monitored_config(tmp_path, tensorboard={"enabled": True,
                                                     "output_path": str(tmp_path / "tb")})
    engine, _, _, scheduler = ds_initialize(model=make_mlp(), config=config)
    try:
        losses, _, _ = train(engine, scheduler, mlp_batches(GAS))
        [writer] = fake_tensorboard
        assert writer.log_dir == str(tmp_path / "tb" / "DeepSpeedJobName")
        assert [name for name, _, _ in writer.scalars] == ["Train/Samples/train_loss",
                                                          "Train/Samples/lr"]
        assert writer.scalars[0][1] == pytest.approx(sum(losses) / GAS, rel=1e-6)
        assert not writer.closed
    finally:
        engine.destroy()
    assert writer.closed
    engine.destroy()  # a second destroy() closes nothing twice


def test_a_monitor_that_cannot_be_made_leaves_no_engine_open(tmp_path):
    # The CSV directory under a regular file: os.makedirs fails on rank 0 after the engine was
    # built; initialize() destroys it before the error propagates.
    (tmp_path / "file").write_text("x")
    config = mlp_config(2)
    config["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path / "file")}
    model = make_mlp()
    open_before = set(_zt._open_engines)
    with pytest.raises(OSError) as failed:
        ds_initialize(model=model, config=config)
    assert set(_zt._open_engines) == open_before, failed.value
    # destroy() leaves the parameters the engine held as empty placeholders.
    assert [p.numel() for p in model.parameters()] == [0] * len(list(model.parameters()))


def test_see_memory_usage_prints_only_when_forced(capsys):
    assert compat._MODULES["deepspeed.runtime.utils"]["see_memory_usage"] is \
        compat.see_memory_usage
    engine, _, _, _ = ds_initialize(model=make_mlp(), config=mlp_config(2))
    try:
        compat.see_memory_usage("not forced")
        assert capsys.readouterr().out == ""
        compat.see_memory_usage("after initialize", force=True)
        out = capsys.readouterr().out
        peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
        memory = engine.memory()
    finally:
        engine.destroy()
    lines = out.splitlines()
    assert lines[0] == "after initialize"
    rss = re.search(r"CPU RSS ([0-9.]+) GB, peak ([0-9.]+) GB", out)
    assert rss, out
    assert 0 < float(rss.group(1)) <= float(rss.group(2))
    assert float(rss.group(2)) == pytest.approx(peak_bytes / 2**30, abs=0.011)
    assert re.search(r"CPU Virtual Memory:  used = [0-9.]+ GB, percent = [0-9.]+%", out), out
    line = [line for line in lines if line.startswith(f"engine {engine._serial} (rank 0)")]
    assert line == [f"engine {engine._serial} (rank 0): device "
                    f"{memory['device_bytes'] / 2**30:.2f} GB, host "
                    f"{memory['host_bytes'] / 2**30:.2f} GB, NVMe "
                    f"{memory['nvme_bytes'] / 2**30:.2f} GB"], out


def test_see_memory_usage_skips_an_engine_whose_initialize_failed(capsys):
    # An engine whose initialize() raised stays among the process's engines while something
    # holds it (here the kept exception's traceback); it has no buffers to report.
    frozen = make_mlp()
    for param in frozen.parameters():
        param.requires_grad_(False)
    with pytest.raises(ValueError) as failed:
        ds_initialize(model=frozen, config=mlp_config(2))
    unfinished = [e for e in _zt._open_engines if not e._core.finalized]
    assert unfinished, failed.value
    engine, _, _, _ = ds_initialize(model=make_mlp(), config=mlp_config(2))
    try:
        compat.see_memory_usage("two engines", force=True)
        out = capsys.readouterr().out
    finally:
        engine.destroy()
        for other in unfinished:
            other.destroy()
    assert out.splitlines()[0] == "two engines"
    assert f"engine {engine._serial} (rank 0): device " in out
    assert f"engine {unfinished[0]._serial} " not in out, out


def test_see_memory_usage_is_silent_off_rank_0_before_torch_distributed(capsys, monkeypatch):
    # Before torch.distributed is initialised (under torchrun, ahead of deepspeed.initialize),
    # the rank is the launcher's, as deepspeed.comm.get_rank() gives it.
    assert not torch.distributed.is_initialized()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    compat.see_memory_usage("off rank 0", force=True)
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    compat.see_memory_usage("on rank 0", force=True)
    assert capsys.readouterr().out.splitlines()[0] == "on rank 0"


# ---- two ranks under torchrun ------------------------------------------------------------------

def test_only_rank_0_writes_its_own_losses(tmp_path):
    if why_torchrun_unavailable() is not None:
        pytest.skip(why_torchrun_unavailable())
    from deepspeed_monitor_run import GAS as RUN_GAS, STEPS as RUN_STEPS

    done = torchrun("deepspeed_monitor_run.py", [tmp_path], timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = []
    for rank in (0, 1):
        with open(tmp_path / f"losses.rank{rank}.json") as f:
            runs.append(json.load(f))
    # engine.monitor.enabled on every rank, as DeepSpeed's; one header, rank 0's rows only.
    assert [run["monitor_enabled"] for run in runs] == [True, True]
    samples = runs[0]["train_batch_size"]
    assert samples == 4 * RUN_GAS * 2
    header, rows = read_csv(tmp_path / "logs" / "run2" / "Train_Samples_train_loss.csv")
    assert header == ["step", "train_loss"]
    assert [step for step, _ in rows] == [k * samples for k in range(RUN_STEPS)]
    for k, (_, value) in enumerate(rows):
        mine = [run["losses"][k * RUN_GAS:(k + 1) * RUN_GAS] for run in runs]
        assert value == pytest.approx(sum(mine[0]) / RUN_GAS, rel=1e-6), k
        assert value != pytest.approx(sum(mine[1]) / RUN_GAS, rel=1e-3), k
    header, rows = read_csv(tmp_path / "logs" / "run2" / "Train_Samples_lr.csv")
    assert [step for step, _ in rows] == [k * samples for k in range(1, RUN_STEPS + 1)]
    # Every rank wrote an event of its own through engine.monitor.write_events: rank 0's alone
    # reached the file.
    assert read_csv(tmp_path / "logs" / "run2" / "Custom_rank.csv") == (["step", "rank"],
                                                                       [(5, 0.0)])
    # Every rank called see_memory_usage(force=True): rank 0 alone printed.
    assert re.findall(r"^memory of rank \d$", done.stdout, re.M) == ["memory of rank 0"], \
        done.stdout[-3000:]
