"""DeepSpeed's monitors (deepspeed/monitor/) for zinf.deepspeed_compat: the config's
"csv_monitor" and "tensorboard" sections, written as DeepSpeed writes them, and engine.monitor.

An event is DeepSpeed's tuple (name, value, step): DeepSpeed's engine names its own
"Train/Samples/train_loss", "Train/Samples/lr" and "Train/Samples/loss_scale", with the step the
engine's global sample count; a script adds its own through engine.monitor.write_events(). Only
rank 0 writes, as in DeepSpeed (its MonitorMaster makes the monitors on rank 0 alone).

- csv_monitor: one file per event name in <output_path>/<job_name>/ (job_name
  "DeepSpeedJobName" unless given; an empty output_path puts it under the working directory):
  the name with "/" and " " replaced by "_", then ".csv". The file is opened for appending, and
  the first write of each name by this monitor (one per initialize(), so an engine made again in
  the same process heads its rows again) adds the header line "step,<the name's last
  '/'-separated part>"; each event is a row "<step>,<value>", through Python's csv module with
  its default (Excel) dialect, so lines end in "\\r\\n", as DeepSpeed's csvMonitor writes them.
- tensorboard: torch.utils.tensorboard's SummaryWriter on <output_path>/<job_name>/, each event
  one add_scalar(name, value, step), flushed after each write_events(), as DeepSpeed's
  TensorBoardMonitor; engine.destroy() closes it. It needs the `tensorboard` package, which
  zinf does not depend on: without it, initialize() raises ImportError naming
  `tensorboard.enabled` (DeepSpeed raises the package's ImportError there too, after printing
  that it wants `pip install tensorboard`).
- wandb and comet: not written by zinf; initialize() warns on rank 0, naming the key.

As DeepSpeed's config models (deepspeed/monitor/config.py over DeepSpeedConfigModel), a key set to
"auto" (the Trainer's placeholder) counts as absent, a section "auto" as no section, and a key the
csv_monitor or tensorboard section does not define is refused (DeepSpeed's models forbid extra
keys).
"""
from __future__ import annotations

import csv
import importlib.util
import os
import warnings

# DeepSpeed's defaults (deepspeed/monitor/config.py: TensorBoardConfig, CSVConfig).
_DEFAULT_JOB_NAME = "DeepSpeedJobName"
_WRITTEN = ("csv_monitor", "tensorboard")
# The keys of the written sections (CSVConfig and TensorBoardConfig define the same three).
_KEYS = ("enabled", "output_path", "job_name")
_NOT_WRITTEN = {"wandb": "Weights & Biases", "comet": "Comet"}


def _section(config: dict, key: str) -> dict:
    """The config's monitor section `key` ({} when absent or "auto") without its keys set to
    "auto", its "enabled" a bool and its paths strings, a written section holding no other key,
    or ValueError naming the key."""
    section = config.get(key, {})
    if section == "auto":
        section = {}
    if not isinstance(section, dict):
        raise ValueError(f"config \"{key}\": expected an object, got {section!r}")
    section = {name: value for name, value in section.items() if value != "auto"}
    if key in _WRITTEN:
        for name in section:
            if name not in _KEYS:
                raise ValueError(f"config \"{key}.{name}\": not a key of this section "
                                 f"({', '.join(_KEYS)}), as in DeepSpeed, which refuses it too")
    enabled = section.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ValueError(f"config \"{key}.enabled\": expected true or false, got {enabled!r}")
    for name in ("output_path", "job_name"):
        if name in section and not isinstance(section[name], str):
            raise ValueError(f"config \"{key}.{name}\": expected a string, got "
                             f"{section[name]!r}")
    return section


def _log_dir(section: dict) -> str:
    """DeepSpeed's directory of a monitor's files: output_path joined with job_name."""
    return os.path.join(section.get("output_path", ""),
                        section.get("job_name", _DEFAULT_JOB_NAME))


def check_config(config: dict, rank: int) -> None:
    """What initialize() checks before it builds the engine, on every rank (so that all of them
    stop alike): the sections' types; `tensorboard.enabled` without the tensorboard package
    raises ImportError. On rank 0 it warns for an enabled wandb or comet section, which zinf
    does not log to."""
    sections = {key: _section(config, key) for key in (*_WRITTEN, *_NOT_WRITTEN)}
    if sections["tensorboard"].get("enabled") and importlib.util.find_spec("tensorboard") is None:
        raise ImportError(
            "config \"tensorboard.enabled\": true, but the tensorboard package is not installed; "
            "`pip install tensorboard` (torch.utils.tensorboard writes through it), or set "
            "\"enabled\": false (\"csv_monitor\" writes the same events to CSV files without "
            "it)", name="tensorboard")
    if rank != 0:
        return
    for key, product in _NOT_WRITTEN.items():
        if sections[key].get("enabled"):
            warnings.warn(
                f"config \"{key}.enabled\": zinf.deepspeed_compat does not log to {product}; the "
                "engine's events (Train/Samples/train_loss, lr, loss_scale) go only to the "
                "\"csv_monitor\" and \"tensorboard\" sections. Log to it from the training "
                "script instead", stacklevel=3)


class CsvMonitor:
    """DeepSpeed's csvMonitor: one CSV file per event name in <output_path>/<job_name>/."""

    def __init__(self, section: dict):
        self.log_dir = _log_dir(section)
        os.makedirs(self.log_dir, exist_ok=True)
        # The names this process has written, whose files have their header line.
        self._headed: set[str] = set()

    def write_events(self, event_list) -> None:
        for name, value, step in event_list:
            filename = name.replace("/", "_").replace(" ", "_")
            with open(os.path.join(self.log_dir, filename + ".csv"), "a+") as f:
                writer = csv.writer(f)
                if filename not in self._headed:
                    self._headed.add(filename)
                    writer.writerow(["step", name.split("/")[-1]])
                writer.writerow([step, value])


class TensorBoardMonitor:
    """DeepSpeed's TensorBoardMonitor: a SummaryWriter on <output_path>/<job_name>/."""

    def __init__(self, section: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = _log_dir(section)
        os.makedirs(self.log_dir, exist_ok=True)
        self.summary_writer = SummaryWriter(log_dir=self.log_dir)

    def write_events(self, event_list) -> None:
        for name, value, step in event_list:
            self.summary_writer.add_scalar(name, value, step)
        self.summary_writer.flush()

    def close(self) -> None:
        """Flushes the writer and ends its thread."""
        self.summary_writer.close()


class MonitorMaster:
    """engine.monitor: DeepSpeed's MonitorMaster over the config's csv_monitor and tensorboard
    sections. `enabled` is true when one of them is (on every rank, as DeepSpeed's is: a script
    tests it before it builds its events; DeepSpeed's is true for an enabled wandb or comet
    section too); write_events(list of (name, value, step)) writes each event to every enabled
    monitor on rank 0 and does nothing on the other ranks. close() ends the TensorBoard writer
    (engine.destroy() calls it); the monitors write nothing afterwards."""

    def __init__(self, config: dict, rank: int):
        sections = {key: _section(config, key) for key in _WRITTEN}
        self.enabled = any(section.get("enabled") for section in sections.values())
        self.rank = rank
        self.csv_monitor = None
        self.tb_monitor = None
        if rank == 0:
            if sections["csv_monitor"].get("enabled"):
                self.csv_monitor = CsvMonitor(sections["csv_monitor"])
            if sections["tensorboard"].get("enabled"):
                self.tb_monitor = TensorBoardMonitor(sections["tensorboard"])

    def write_events(self, event_list) -> None:
        if self.rank != 0:
            return
        event_list = list(event_list)
        for monitor in (self.tb_monitor, self.csv_monitor):
            if monitor is not None:
                monitor.write_events(event_list)

    def close(self) -> None:
        tb_monitor, self.tb_monitor, self.csv_monitor = self.tb_monitor, None, None
        if tb_monitor is not None:
            tb_monitor.close()
