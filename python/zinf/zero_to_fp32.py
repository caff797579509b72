#!/usr/bin/env python
"""The consolidated fp32 weights of a zinf checkpoint, offline: DeepSpeed's zero_to_fp32.py for
zinf checkpoints. zinf.deepspeed_compat's save_checkpoint writes this file into the checkpoint
directory, as DeepSpeed's engine writes its script there, so that

    cd <save_dir> && python zero_to_fp32.py . <output_dir>

writes <output_dir>/pytorch_model.bin (torch.save of {name: fp32 tensor}), or with
--safe_serialization <output_dir>/model.safetensors, from the tag <save_dir>/latest names (-t TAG
for another); weights over --max_shard_size (default 5GB) go into shards and an index named as
DeepSpeed's script and Hugging Face name them (pytorch_model-00001-of-00002.bin and
pytorch_model.bin.index.json), written one at a time. The command line is DeepSpeed's
(deepspeed/utils/zero_to_fp32.py): checkpoint_dir, output_dir, --safe_serialization, -t/--tag,
--exclude_frozen_parameters, --max_shard_size, -d. The weights are
zinf.torch.get_fp32_state_dict_from_zero_checkpoint()'s: every parameter's fp32 master, gathered
by name from the ranks' files whatever the world size that saved them, the frozen parameters
(left out, at every stage, with --exclude_frozen_parameters) and the model's persistent buffers
(BatchNorm's running statistics: the floating ones in fp32, a count in its integer dtype, where
DeepSpeed's script writes every buffer in fp32), each under its first name (a tied weight once:
the checkpoint does not record its other names, which DeepSpeed's script adds). It needs the
zinf package (python -m zinf.zero_to_fp32 runs the same). Files are written under a temporary
name and renamed, so that an output file is whole or absent. Weight files of an earlier export
that this one did not write (model.safetensors beside a new pytorch_model.bin, say, which
transformers' from_pretrained would load first) are left in place with a warning naming them.
"""
import argparse
import json
import os
import re
import sys
import warnings

import torch

# DeepSpeed hands --max_shard_size to huggingface_hub, which reads decimal units (KB, MB, GB, TB);
# the binary ones (KiB, ...) and the bare letters (5G) are read too, and a float before the unit.
_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9,
          "GB": 10**9, "T": 10**12, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
          "TIB": 2**40}


def _bytes_of(size) -> int:
    """A size as DeepSpeed's --max_shard_size takes it: "5GB", "5G", "1.5GB", "500MB", "2GiB", or
    a number of bytes. Anything else is ValueError naming it."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Z]*)\s*", str(size).upper())
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(f"--max_shard_size {size!r}: a number of bytes, or a number followed by "
                         "a unit (KB, MB, GB, TB, KiB, MiB, GiB, TiB), such as 5GB")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def _shards(sizes: dict, max_bytes: int) -> list:
    """The names of each file, as huggingface_hub's split_torch_state_dict_into_shards (which
    DeepSpeed's script uses) groups them: in the state dict's order, a new file where the next
    weight would take the current one over max_bytes, and a weight over max_bytes alone in its
    own file."""
    shards, current, current_bytes = [], [], 0
    for name, tensor_bytes in sizes.items():
        if tensor_bytes > max_bytes:
            shards.append([name])
            continue
        if current and current_bytes + tensor_bytes > max_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += tensor_bytes
    if current or not shards:
        shards.append(current)
    return shards


def _write_atomically(path: str, write) -> None:
    """write(temporary) then a rename to `path`, so that the file is whole or absent."""
    directory, name = os.path.split(path)
    temporary = os.path.join(directory, f".{name}.tmp")
    write(temporary)
    with open(temporary, "rb") as f:
        os.fsync(f.fileno())
    os.replace(temporary, path)


# The weight files transformers' from_pretrained looks for, in the order it prefers them:
# model.safetensors, its index, pytorch_model.bin, its index (and the shards the indexes name).
_WEIGHT_FILE = re.compile(r"(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json"
                          r"|pytorch_model(-\d{5}-of-\d{5})?\.bin|pytorch_model\.bin\.index\.json)")


def _warn_of_stale_files(output_dir: str, written: list) -> None:
    """Warns naming the weight files in output_dir that this export did not write (an earlier
    export's, of the other format or another number of shards): from_pretrained reads
    model.safetensors before pytorch_model.bin, so a stale one would be loaded in place of the
    weights just written. They are left as they are (DeepSpeed's script leaves them too)."""
    stale = sorted(name for name in os.listdir(output_dir)
                   if _WEIGHT_FILE.fullmatch(name) and name not in written)
    if stale:
        warnings.warn(
            f"zero_to_fp32: {output_dir} also holds weight files this export did not write: "
            f"{', '.join(stale)}; transformers' from_pretrained reads model.safetensors (and "
            f"its index) before pytorch_model.bin (and its index), so it may load those in "
            f"place of the weights just written ({', '.join(written)}): remove them, or export "
            f"into an empty directory", stacklevel=3)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization=False, tag=None,
                                               exclude_frozen_parameters=False):
    """DeepSpeed's function of that name: writes the checkpoint's fp32 weights into output_dir
    (created if needed) as pytorch_model.bin, or model.safetensors with safe_serialization; where
    they are over max_shard_size (None: no limit), as DeepSpeed's and Hugging Face's shards
    (pytorch_model-00001-of-0000N.bin ..., model-00001-of-0000N.safetensors ...) and their index
    (pytorch_model.bin.index.json / model.safetensors.index.json: {"metadata": {"total_size"},
    "weight_map": {name: file}}). One file's weights are in memory at a time. Returns the path
    of the file written, or of the index."""
    from zinf.torch import get_fp32_state_dict_from_zero_checkpoint

    max_bytes = None if max_shard_size is None else _bytes_of(max_shard_size)
    state = get_fp32_state_dict_from_zero_checkpoint(
        checkpoint_dir, tag, exclude_frozen_parameters=exclude_frozen_parameters, lazy_mode=True)
    sizes = {name: weight.numel() * weight.element_size() for name, weight in state.items()}
    weights_name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    shards = [list(sizes)] if max_bytes is None else _shards(sizes, max_bytes)
    if len(shards) == 1:
        files = {weights_name: shards[0]}
    else:
        stem, extension = weights_name.split(".", 1)
        files = {f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{extension}": names
                 for i, names in enumerate(shards)}
    os.makedirs(output_dir, exist_ok=True)
    for file, names in files.items():
        tensors = {name: state.pop(name).contiguous() for name in names}
        if safe_serialization:
            from safetensors.torch import save_file
            _write_atomically(os.path.join(output_dir, file),
                              lambda path: save_file(tensors, path, metadata={"format": "pt"}))
        else:
            _write_atomically(os.path.join(output_dir, file),
                              lambda path: torch.save(tensors, path))
        del tensors
    if len(files) == 1:
        _warn_of_stale_files(output_dir, [weights_name])
        return os.path.join(output_dir, weights_name)
    index = {"metadata": {"total_size": sum(sizes.values())},
             "weight_map": {name: file for file, names in files.items() for name in names}}
    path = os.path.join(output_dir, f"{weights_name}.index.json")

    def write_index(temporary):
        with open(temporary, "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")

    _write_atomically(path, write_index)
    _warn_of_stale_files(output_dir, [*files, f"{weights_name}.index.json"])
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Write a zinf checkpoint's consolidated fp32 weights (DeepSpeed's "
                    "zero_to_fp32.py command line)")
    parser.add_argument("checkpoint_dir", type=str,
                        help="the checkpoint directory (the one holding `latest` and the tags)")
    parser.add_argument("output_dir", type=str,
                        help="the directory for pytorch_model.bin or model.safetensors")
    parser.add_argument("--max_shard_size", type=str, default="5GB",
                        help="the largest file written (5GB, 500MB, 2GiB, bytes); larger weights "
                             "are written in shards with an index, as Hugging Face's")
    parser.add_argument("--safe_serialization", default=False, action="store_true",
                        help="write model.safetensors instead of pytorch_model.bin")
    parser.add_argument("-t", "--tag", type=str, default=None,
                        help="the checkpoint's tag, e.g. global_step1 (default: `latest`'s)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true",
                        help="leave out the frozen parameters (requires_grad False)")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted; no effect")
    args = parser.parse_args(argv)
    path = convert_zero_checkpoint_to_fp32_state_dict(
        args.checkpoint_dir, args.output_dir, max_shard_size=args.max_shard_size,
        safe_serialization=args.safe_serialization, tag=args.tag,
        exclude_frozen_parameters=args.exclude_frozen_parameters)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
