"""The model and the data of examples/torch_gpt, shared by train.py and the package's tests.

A GPT-2 from transformers with a small config and a random init (nothing downloaded), over bytes
as tokens (vocabulary 256), and batches of byte windows of examples/data/kjv_pentateuch.txt drawn
by a seeded generator.
"""
from __future__ import annotations

import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data",
                    "kjv_pentateuch.txt")


def make_model(seed: int = 1, layers: int = 2, width: int = 64, heads: int = 4,
               context: int = 64) -> GPT2LMHeadModel:
    """A GPT-2 of `layers` blocks of `width`, random weights from `seed`, dropout off (so runs
    are comparable step by step). Its input and output embeddings are tied, as in GPT-2."""
    config = GPT2Config(vocab_size=256, n_positions=context, n_embd=width, n_layer=layers,
                        n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


def read_text(path: str = DATA) -> torch.Tensor:
    with open(path, "rb") as f:
        return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()


def batches(text: torch.Tensor, batch_size: int, sequence: int, seed: int = 2):
    """Endless (input_ids, labels) batches of `sequence` bytes at random offsets; GPT-2 shifts
    the labels itself, so they are the inputs."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, text.numel() - sequence, (batch_size,), generator=generator)
        ids = torch.stack([text[s:s + sequence] for s in starts.tolist()])
        yield ids, ids
