"""The model of the Init tests: byte embeddings, a stack of square Linear layers with tanh, a
LayerNorm and a byte head, its loss the cross-entropy of the next byte. Plain torch modules, so
every parameter is initialised by its module's constructor (what Init stages)."""
import torch
from torch import nn


class Stack(nn.Module):
    def __init__(self, width: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256)

    def forward(self, ids, labels):
        x = self.embed(ids)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def batch(seed: int, rows: int = 2, length: int = 8):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (rows, length + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def config(nvme_path, width: int, stage: int = 3, offload: str = "nvme", bf16: bool = False,
           **zero):
    """Stage 3 with parameters and optimizer state on NVMe, gradients spilled to NVMe, and the
    host buffers sized by a layer rather than by the model: sub-groups of a quarter layer (at
    most 1M elements), two optimizer and two parameter staging buffers, buckets of a layer, three
    layers live."""
    square = width * width
    zero_config = {
        "stage": stage,
        "offload_param": {"device": offload, "nvme_path": str(nvme_path), "buffer_count": 2},
        "offload_optimizer": {"device": offload, "nvme_path": str(nvme_path), "buffer_count": 2},
        "sub_group_size": max(min(square // 4, 1 << 20), 4096),
        "reduce_bucket_size": square,
        "stage3_prefetch_bucket_size": square,
        "stage3_max_live_parameters": 3 * max(square, 256 * width),
        "stage3_param_persistence_threshold": 0,
    }
    zero_config.update(zero)
    return {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": bf16},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": zero_config,
        "zinf": {"cpu_threads": 1, "gradients_on_nvme": offload == "nvme",
                 "gradient_spill_buffers": 2},
    }
