"""The offline readers of a checkpoint (get_fp32_state_dict_from_zero_checkpoint,
load_state_dict_from_zero_checkpoint, zero_to_fp32.py) check the client state as a load does:
client_state.bin (the frozen parameters of stages 1 and 2 and the persistent buffers) is
compared with its size and xxh3-64 in the manifest before torch.load reads it, so that a flipped
byte is an error naming the file and not a wrong weight; and they read a tag that a replacing save
left moved aside as .<tag>.old, where the C++ export and load_checkpoint read it. zinf._xxh3, the
checksum those checks compute, is compared with libxxhash's XXH3_64bits on every length class."""
import ctypes
import ctypes.util
import os
import random

import numpy as np
import pytest
import torch
from torch import nn

import zinf.torch
import zinf.zero_to_fp32 as zero_to_fp32
from zinf import _xxh3

SEED = 20261206


def make_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(checkpoint directory, tag, the weights get_fp32_state_dict_from_zero_checkpoint gives):
    a stage-2 engine whose first Linear is frozen (so its weights are in the client state),
    trained 2 steps and saved as tag "t"."""
    model = make_model(0)
    for p in model[0].parameters():
        p.requires_grad_(False)
    config = {"train_micro_batch_size_per_gpu": 16, "zinf": {"cpu_threads": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 2}}
    engine, _, _, _ = zinf.torch.initialize(
        model=model, config=config,
        model_parameters=[p for p in model.parameters() if p.requires_grad])
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
    model = make_model(0)
    for p in model[0].parameters():
        p.requires_grad_(False)
    config = {"train_micro_batch_size_per_gpu": 16, "zinf": {"cpu_threads": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 2}}
    engine, _, _, _ = zinf.torch.initialize(
        model=model, config=config,
        model_parameters=[p for p in model.parameters() if p.requires_grad])
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


def _libxxhash():
    name = ctypes.util.find_library("xxhash")
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    lib.XXH3_64bits.restype = ctypes.c_uint64
    lib.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    return lib


def test_xxh3_matches_libxxhash_on_every_length_class():
    # The published value of the empty input, then libxxhash's on seeded random bytes of each
    # length XXH3 treats differently (0, 1-3, 4-8, 9-16, 17-128, 129-240, a stripe, a block, many
    # blocks with a tail, an exact number of blocks), from aligned and unaligned starts.
    assert _xxh3.xxh3_64(b"") == 0x2D06800538D394C2
    lib = _libxxhash()
    if lib is None:
        pytest.skip("libxxhash is not installed: the lengths over 0 have no reference here")
    rng = np.random.default_rng(SEED)
    data = rng.integers(0, 256, size=(1 << 20) + 64, dtype=np.uint8).tobytes()
    lengths = [1, 2, 3, 4, 5, 8, 9, 15, 16, 17, 32, 33, 64, 65, 96, 97, 128, 129, 130, 239, 240,
               241, 256, 1023, 1024, 1025, 1088, 1089, 4096, 65536 + 7, 1 << 20]
    for start in (0, 1, 37):
        for length in lengths:
            piece = data[start:start + length]
            assert _xxh3.xxh3_64(piece) == lib.XXH3_64bits(piece, length), (start, length)
    # The long path across _CHUNK_BLOCKS: more blocks than numpy reduces at a time.
    big = rng.integers(0, 256, size=_xxh3._CHUNK_BLOCKS * 1024 * 2 + 300, dtype=np.uint8)
    assert _xxh3.xxh3_64(big) == lib.XXH3_64bits(big.tobytes(), big.size)


def test_xxh3_of_a_file_is_the_manifests(saved):
    """The checksum of the saved files, computed here, is the one the C++ side wrote."""
    import json
    manifest = json.load(open(os.path.join(saved[0], "t", "manifest.json")))
    for entry in manifest["client_state"] + [r for r in manifest["ranks"] if "blocks" not in r]:
        path = os.path.join(saved[0], "t", entry["file"])
        assert _xxh3.xxh3_64_file(path) == (entry["bytes"], int(entry["xxh3"], 16)), path
