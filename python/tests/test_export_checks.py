"""The offline readers of a checkpoint (get_fp32_state_dict_from_zero_checkpoint,
load_state_dict_from_zero_checkpoint, zero_to_fp32.py) check the client state as a load does:
client_state.bin (the frozen parameters of stages 1 and 2 and the persistent buffers) is
compared with its size and xxh3-64 in the manifest before torch.load reads it, so that a flipped
byte is an error naming the file and not a wrong weight; and they read a tag that a replacing save
left moved aside as .<tag>.old, where the C++ export and load_checkpoint read it. The checksum
those checks compute, libxxhash's XXH3-64 exposed by the extension (zinf._zinf.xxh3_64 and
xxh3_64_file), is compared with the published value of the empty input and with the checksums the
C++ save wrote into the manifest."""
import json
import os
import random

import numpy as np
import pytest
import torch
from torch import nn

import zinf.torch
import zinf.zero_to_fp32 as zero_to_fp32
from zinf import _zinf

SEED = 20261206


def make_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))


def frozen_first_linear_engine():
    """(model, engine): a stage-2 engine over make_model(0) whose first Linear is frozen, so its
    weights go to the client state."""
    model = make_model(0)
    for p in model[0].parameters():
        p.requires_grad_(False)
    config = {"train_micro_batch_size_per_gpu": 16, "zinf": {"cpu_threads": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 2}}
    engine, _, _, _ = zinf.torch.initialize(
        model=model, config=config,
        model_parameters=[p for p in model.parameters() if p.requires_grad])
    return model, engine


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(checkpoint directory, tag, the weights get_fp32_state_dict_from_zero_checkpoint gives):
    a stage-2 engine whose first Linear is frozen (so its weights are in the client state),
    trained 2 steps and saved as tag "t"."""
    model, engine = frozen_first_linear_engine()
    generator = torch.Generator().manual_seed(1)
    try:
        for _ in range(2):
            x = torch.randn(16, 8, generator=generator) * 3 + 1
            engine.backward(engine(x).pow(2).mean())
            engine.step()
        save_dir = tmp_path_factory.mktemp("ckpt")
        engine.save_checkpoint(str(save_dir), tag="t")
    finally:
        engine.destroy()
    weights = zinf.torch.get_fp32_state_dict_from_zero_checkpoint(str(save_dir))
    # The client state's share: the frozen Linear and BatchNorm's statistics.
    assert {"0.weight", "0.bias", "1.running_mean", "1.num_batches_tracked"} <= set(weights)
    return str(save_dir), "t", weights


def copy_checkpoint(source: str, target) -> str:
    import shutil
    shutil.copytree(source, target, symlinks=True)
    return str(target)


def flip_one_byte(path: str, seed: int, within: bytes | None = None) -> int:
    """Flips one bit of one byte of `path`, at an offset drawn from `seed` (within the first
    occurrence of the bytes `within`, where given); returns the offset."""
    with open(path, "rb") as f:
        content = f.read()
    first, last = 0, len(content)
    if within is not None:
        first = content.index(within)
        last = first + len(within)
    offset = random.Random(seed).randrange(first, last)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes([content[offset] ^ 0x04]))
    return offset


@pytest.mark.parametrize("lazy", [False, True], ids=["whole", "lazy"])
@pytest.mark.parametrize("where", ["frozen_values", "anywhere"])
def test_a_flipped_byte_of_the_client_state_is_refused_naming_the_file(saved, tmp_path, lazy,
                                                                       where):
    save_dir = copy_checkpoint(saved[0], tmp_path / "ckpt")
    client = os.path.join(save_dir, "t", "client_state.bin")
    # In the frozen weight's stored values, torch.load reads a wrong value without a word (a
    # zip's CRCs are not checked); elsewhere it may fail with its own message.
    within = saved[2]["0.weight"].numpy().tobytes() if where == "frozen_values" else None
    offset = flip_one_byte(client, SEED, within)
    print(f"seed {SEED}: flipped byte {offset} of {client}")
    # load_checkpoint refuses the file; the offline readers now say the same.
    with pytest.raises(zinf.torch.Error,
                       match=f"'{client}' does not match its size and checksum in the manifest"):
        zinf.torch.get_fp32_state_dict_from_zero_checkpoint(save_dir, lazy_mode=lazy)
    with pytest.raises(zinf.torch.Error, match=f"'{client}' does not match its size and checksum"):
        zinf.torch.load_state_dict_from_zero_checkpoint(make_model(5), save_dir)
    out = tmp_path / "out"
    with pytest.raises(zinf.torch.Error, match=f"'{client}' does not match its size and checksum"):
        zero_to_fp32.main([save_dir, str(out)])
    assert not out.exists() or not os.listdir(out)


def test_load_checkpoint_refuses_the_same_flipped_byte(saved, tmp_path):
    """The message the offline readers give is load_checkpoint's."""
    save_dir = copy_checkpoint(saved[0], tmp_path / "ckpt")
    client = os.path.join(save_dir, "t", "client_state.bin")
    flip_one_byte(client, SEED, saved[2]["0.weight"].numpy().tobytes())
    model, engine = frozen_first_linear_engine()
    try:
        with pytest.raises(zinf.torch.Error,
                           match=f"'{client}' does not match its size and checksum in the "
                                 "manifest"):
            engine.load_checkpoint(save_dir)
    finally:
        engine.destroy()


def test_a_client_state_of_another_size_is_refused_naming_the_file(saved, tmp_path):
    save_dir = copy_checkpoint(saved[0], tmp_path / "ckpt")
    client = os.path.join(save_dir, "t", "client_state.bin")
    with open(client, "ab") as f:
        f.write(b"\0")
    with pytest.raises(zinf.torch.Error, match=f"'{client}' does not match its size and checksum"):
        zinf.torch.get_fp32_state_dict_from_zero_checkpoint(save_dir,
                                                             exclude_frozen_parameters=True)


def test_a_missing_client_state_the_manifest_lists_is_refused(saved, tmp_path):
    save_dir = copy_checkpoint(saved[0], tmp_path / "ckpt")
    client = os.path.join(save_dir, "t", "client_state.bin")
    os.unlink(client)
    with pytest.raises(FileNotFoundError, match=f"'{client}'"):
        zinf.torch.get_fp32_state_dict_from_zero_checkpoint(save_dir)


def test_a_tag_moved_aside_by_a_replacing_save_is_read_where_it_is(saved, tmp_path):
    """A save replacing tag "t" moves it to .t.old first; cut short before it renamed the new
    one in, it leaves only .t.old, which load_checkpoint and the C++ export read as tag "t": the
    offline readers give the same weights from it, the client state's included."""
    save_dir = copy_checkpoint(saved[0], tmp_path / "ckpt")
    os.rename(os.path.join(save_dir, "t"), os.path.join(save_dir, ".t.old"))
    for tag in ("t", None):  # by name, and as `latest` names it
        weights = zinf.torch.get_fp32_state_dict_from_zero_checkpoint(save_dir, tag=tag)
        assert sorted(weights) == sorted(saved[2])
        for name, value in saved[2].items():
            assert torch.equal(weights[name], value), name
    # Its client state is checked there too.
    flip_one_byte(os.path.join(save_dir, ".t.old", "client_state.bin"), SEED)
    client = os.path.join(save_dir, ".t.old", "client_state.bin")
    with pytest.raises(zinf.torch.Error, match=f"'{client}' does not match its size and checksum"):
        zinf.torch.get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="t")


def test_xxh3_64_gives_the_published_value_and_the_manifests_own_checksum(saved):
    # XXH3_64bits of the empty input, as xxHash publishes it.
    assert _zinf.xxh3_64(b"") == 0x2D06800538D394C2
    # The manifest's checksum, written by the C++ save: the xxh3-64 of its text with the
    # checksum's 16 digits as zeros.
    with open(os.path.join(saved[0], "t", "manifest.json"), "rb") as f:
        text = f.read()
    key = b'"checksum": "'
    begin = text.index(key) + len(key)
    stored = int(text[begin:begin + 16], 16)
    assert _zinf.xxh3_64(text[:begin] + b"0" * 16 + text[begin + 16:]) == stored
    assert _zinf.xxh3_64(text) != stored


def test_xxh3_of_a_file_is_the_manifests(saved):
    """The checksum of the saved files, computed here, is the one the C++ side wrote."""
    manifest = json.load(open(os.path.join(saved[0], "t", "manifest.json")))
    entries = manifest["client_state"] + [r for r in manifest["ranks"] if "blocks" not in r]
    assert entries
    for entry in entries:
        path = os.path.join(saved[0], "t", entry["file"])
        assert _zinf.xxh3_64_file(path) == (entry["bytes"], int(entry["xxh3"], 16)), path


def test_xxh3_of_a_file_read_in_many_blocks_is_that_of_its_bytes(tmp_path):
    # Seeded random bytes over several of the 1 MiB blocks the file is read in, with a tail, and
    # lengths around one block: the streamed hash is the one-shot hash of the same bytes.
    rng = np.random.default_rng(SEED)
    data = rng.integers(0, 256, size=(3 << 20) + 300, dtype=np.uint8).tobytes()
    for length in (0, 1, 240, 241, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, len(data)):
        path = tmp_path / f"data{length}.bin"
        path.write_bytes(data[:length])
        assert _zinf.xxh3_64_file(str(path)) == (length, _zinf.xxh3_64(data[:length])), length
    assert _zinf.xxh3_64(data[:-1]) != _zinf.xxh3_64(data)


def test_xxh3_of_a_file_that_cannot_be_read_is_an_os_error_naming_it(tmp_path):
    missing = str(tmp_path / "missing.bin")
    message = "No such file or directory: cannot open it to compute its xxh3-64"
    with pytest.raises(FileNotFoundError, match=message) as raised:
        _zinf.xxh3_64_file(missing)
    assert raised.value.filename == missing
    assert f"'{missing}'" in str(raised.value)
    # A directory opens but cannot be read.
    with pytest.raises(IsADirectoryError, match="cannot read it at offset 0") as raised:
        _zinf.xxh3_64_file(str(tmp_path))
    assert raised.value.filename == str(tmp_path)
