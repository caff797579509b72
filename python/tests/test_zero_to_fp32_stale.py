"""zero_to_fp32 into a directory that holds an earlier export's weight files: those this export
did not write (model.safetensors beside a new pytorch_model.bin, which transformers'
from_pretrained would load first; the shards and index of an earlier sharded export) are named in
a warning and left in place; a repeated export of the same form overwrites its files without
one."""
import os
import warnings

import pytest
import torch
from torch import nn

import zinf.torch
import zinf.zero_to_fp32 as zero_to_fp32


@pytest.fixture(scope="module")
def save_dir(tmp_path_factory):
    """A stage-1 checkpoint of two Linear layers (4 weights of 1 KiB or less), one step in."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 1))
    config = {"train_micro_batch_size_per_gpu": 4, "zinf": {"cpu_threads": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 1}}
    engine, _, _, _ = zinf.torch.initialize(model=model, config=config)
    try:
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(4))
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        path = tmp_path_factory.mktemp("ckpt")
        engine.save_checkpoint(str(path))
    finally:
        engine.destroy()
    return str(path)


def export(save_dir, out, *options):
    assert zero_to_fp32.main([save_dir, str(out), *options]) == 0


def test_a_safetensors_export_left_beside_a_bin_export_is_named(save_dir, tmp_path):
    pytest.importorskip("safetensors", reason="safetensors is not installed")
    out = tmp_path / "out"
    export(save_dir, out, "--safe_serialization")
    with pytest.warns(UserWarning) as caught:
        export(save_dir, out)
    message = "".join(str(w.message) for w in caught if w.category is UserWarning)
    assert (f"zero_to_fp32: {out} also holds weight files this export did not write: "
            "model.safetensors; transformers' from_pretrained reads model.safetensors") in message
    assert "(pytorch_model.bin): remove them, or export into an empty directory" in message
    # Left in place, and the new file is whole.
    assert sorted(os.listdir(out)) == ["model.safetensors", "pytorch_model.bin"]
    assert sorted(torch.load(out / "pytorch_model.bin")) == ["0.bias", "0.weight", "1.bias",
                                                            "1.weight"]


def test_the_shards_of_an_earlier_export_are_named(save_dir, tmp_path):
    out = tmp_path / "out"
    export(save_dir, out, "--max_shard_size", "600B")
    shards = sorted(name for name in os.listdir(out) if name.startswith("pytorch_model-"))
    assert len(shards) > 1
    with pytest.warns(UserWarning) as caught:
        export(save_dir, out)
    message = "".join(str(w.message) for w in caught if w.category is UserWarning)
    stale = ", ".join(sorted([*shards, "pytorch_model.bin.index.json"]))
    assert f"did not write: {stale};" in message


def test_the_same_export_again_gives_no_warning(save_dir, tmp_path):
    out = tmp_path / "out"
    export(save_dir, out, "--max_shard_size", "600B")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        export(save_dir, out, "--max_shard_size", "600B")
    for name in os.listdir(out):
        os.unlink(out / name)
    export(save_dir, out)
    # Other files (a config, a temporary name) are not weight files.
    (out / "config.json").write_text("{}")
    (out / ".model.safetensors.tmp").write_text("")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        export(save_dir, out)
