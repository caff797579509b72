#!/usr/bin/env python
"""The consolidated fp32 weights of a zinf checkpoint, offline: DeepSpeed's zero_to_fp32.py for
zinf checkpoints. zinf.deepspeed_compat's save_checkpoint writes this file into the checkpoint
directory, as DeepSpeed's engine writes its script there, so that

    cd <save_dir> && python zero_to_fp32.py . <output_dir>

writes <output_dir>/pytorch_model.bin (torch.save of {name: fp32 tensor}), or with
--safe_serialization <output_dir>/model.safetensors, from the tag <save_dir>/latest names (-t TAG
for another). The command line is DeepSpeed's (deepspeed/utils/zero_to_fp32.py): checkpoint_dir,
output_dir, --safe_serialization, -t/--tag, --exclude_frozen_parameters, --max_shard_size, -d.
The weights are zinf.torch.get_fp32_state_dict_from_zero_checkpoint()'s: every parameter's fp32
master, gathered by name from the ranks' files whatever the world size that saved them, and the
frozen parameters the checkpoint keeps (stages 1 and 2), each under its first name (a tied weight
once). It needs the zinf package (python -m zinf.zero_to_fp32 runs the same). Files are written
under a temporary name and renamed, so that an output file is whole or absent.
"""
import argparse
import os
import re
import sys

import torch

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10,
          "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _bytes_of(size: str) -> int:
    """A size as DeepSpeed's --max_shard_size takes it ("5GB", "500MB", "2GiB", or bytes)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMGT]?I?B?)\s*", str(size).upper())
    if match is None:
        raise ValueError(f"--max_shard_size {size!r}: digits followed by a unit such as 5GB")
    return int(match.group(1)) * _UNITS[match.group(2)]


def _frozen_names(checkpoint_dir: str, tag) -> set:
    """The names of the frozen parameters zinf.torch saved in the tag's client state (stages 1
    and 2, where the engine does not hold them)."""
    if tag is None:
        with open(os.path.join(checkpoint_dir, "latest")) as f:
            tag = f.read().strip()
    path = os.path.join(checkpoint_dir, str(tag), "client_state.bin")
    if not os.path.isfile(path):
        return set()
    state = torch.load(path, weights_only=False)
    return set(state.get("frozen", {})) if isinstance(state, dict) else set()


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization=False, tag=None,
                                               exclude_frozen_parameters=False):
    """DeepSpeed's function of that name: writes the checkpoint's fp32 weights into output_dir
    (created if needed) as pytorch_model.bin, or model.safetensors with safe_serialization. One
    file: weights larger than max_shard_size are refused (DeepSpeed would shard them, with
    huggingface_hub), naming the size. Returns the path written."""
    from zinf.torch import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    if exclude_frozen_parameters:
        for name in _frozen_names(checkpoint_dir, tag):
            state.pop(name, None)
    total_bytes = sum(t.numel() * t.element_size() for t in state.values())
    if max_shard_size is not None and total_bytes > _bytes_of(max_shard_size):
        raise ValueError(f"the weights are {total_bytes} bytes, over --max_shard_size "
                         f"{max_shard_size}; this script writes one file: pass a larger size")
    os.makedirs(output_dir, exist_ok=True)
    name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    path = os.path.join(output_dir, name)
    temporary = os.path.join(output_dir, f".{name}.tmp")
    if safe_serialization:
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in state.items()}, temporary,
                  metadata={"format": "pt"})
    else:
        torch.save(state, temporary)
    with open(temporary, "rb") as f:
        os.fsync(f.fileno())
    os.replace(temporary, path)
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
                        help="the largest file written; larger weights are refused (one file)")
    parser.add_argument("--safe_serialization", default=False, action="store_true",
                        help="write model.safetensors instead of pytorch_model.bin")
    parser.add_argument("-t", "--tag", type=str, default=None,
                        help="the checkpoint's tag, e.g. global_step1 (default: `latest`'s)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true",
                        help="leave out the frozen parameters kept in the checkpoint")
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
