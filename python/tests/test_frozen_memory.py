"""What a frozen LoRA base costs in host memory (engine.memory()["host_bytes"]) with bf16
training and the optimizer state in host memory (offload_optimizer cpu): a base whose values bf16
holds exactly (bf16 tensors, as a base loaded from a bf16 checkpoint is) against the same draw
kept in fp32, which bf16 does not hold.

At stage 3 the base is an engine parameter registered frozen, and zinf.torch registers its
values widened to fp32 (a bf16 tensor's exactly), so the engine's fp32 master of the bf16 base is
its bf16 copy bit for bit and is not kept (docs/ENGINE.md "Frozen parameters"): 4 bytes a frozen
element fewer than with the fp32 base, whose master is kept, with the shards on the device and
in host memory (offload_param cpu). In host memory the base's shards are lent from the optimizer
state's bf16 copy, whatever its values: they take no host bytes. At stages 1 and 2 the engine
does not hold the base at all (it stays a module tensor in bf16): the adapters' state alone.
Where a base weight shares a sub-group with adapters (sizes off the 1024-element grid), the
frozen elements there keep their master, and the base's group its own shard. In every case
the adapters train to the same bits with either base, since both compute in bf16 with the same
values."""
import functools

import pytest
import torch
from torch import nn

import zinf.torch
from conftest import zinf_config

WIDTH, RANK, LAYERS, STEPS = 512, 8, 3, 3


class LoraLayer(nn.Module):
    """A frozen Linear plus a trainable low-rank update: base(x) + lora_b(lora_a(x))."""

    def __init__(self, width):
        super().__init__()
        self.base = nn.Linear(width, width, bias=False)
        self.base.requires_grad_(False)
        self.lora_a = nn.Linear(width, RANK, bias=False)
        self.lora_b = nn.Linear(RANK, width, bias=False)

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x))


class LoraModel(nn.Module):
    def __init__(self, width, layers):
        super().__init__()
        self.layers = nn.ModuleList(LoraLayer(width) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def make(exact_base, width=WIDTH, layers=LAYERS):
    """The model with seeded weights (the adapters too: LoRA's zero lora_b would hide a wrong
    update). With `exact_base` the base weights are bf16 tensors (the drawn values rounded);
    otherwise fp32 tensors of the drawn values, which bf16 does not hold."""
    torch.manual_seed(61)
    model = LoraModel(width, layers)
    for layer in model.layers:
        with torch.no_grad():
            layer.base.weight.normal_(0.0, width ** -0.5)
            layer.lora_a.weight.normal_(0.0, 0.05)
            layer.lora_b.weight.normal_(0.0, 0.05)
        if exact_base:
            layer.base.to(torch.bfloat16)
    return model


def batches(width):
    generator = torch.Generator().manual_seed(62)
    return [(torch.randn(4, width, generator=generator),
             torch.randn(4, width, generator=generator) * 0.5) for _ in range(STEPS)]


def frozen_elements(model):
    return sum(p.numel() for p in model.parameters() if not p.requires_grad)


@functools.lru_cache(maxsize=None)
def run(exact_base, stage, offload_param, width=WIDTH, layers=LAYERS):
    """Trains the model STEPS steps with the optimizer state in host memory; returns its
    engine's host_bytes after them, every parameter's engine values (read_parameter, fp32) and
    the base weights as drawn (each run's, cached: the tests only read them)."""
    model = make(exact_base, width, layers)
    drawn = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    config = zinf_config(stage, offload="cpu", offload_param=offload_param, bf16=True,
                         stage3_param_persistence_threshold=0)
    engine, _, _, _ = zinf.torch.initialize(model=model, config=config,
                                            model_parameters=model.parameters())
    try:
        for x, y in batches(width):
            loss = (engine(x.to(torch.bfloat16)).float() - y).pow(2).mean()
            engine.backward(loss)
            engine.step()
        host_bytes = engine.memory()["host_bytes"]
        values = {n: engine.read_parameter(n) for n, _ in model.named_parameters()}
    finally:
        engine.destroy()
    return host_bytes, values, drawn


def check_same_adapters(exact, drawn, width=WIDTH, layers=LAYERS):
    """Both bases compute in bf16 with the same values, so the adapters train to the same bits;
    and they did train."""
    start = {n: p.detach().float() for n, p in make(True, width, layers).named_parameters()
             if p.requires_grad}
    assert len(start) == 2 * layers
    for name, initial in start.items():
        assert torch.equal(exact[name], drawn[name]), name
        assert not torch.equal(exact[name], initial), name


def check_same_draw(exact_drawn, fp32_drawn, layers=LAYERS):
    """The two bases are one draw: the bf16 one is the fp32 one rounded, which bf16 does not
    hold."""
    assert len(fp32_drawn) == layers
    for name in fp32_drawn:
        assert exact_drawn[name].dtype == torch.bfloat16
        assert torch.equal(exact_drawn[name], fp32_drawn[name].to(torch.bfloat16)), name
        assert not torch.equal(exact_drawn[name].float(), fp32_drawn[name]), name


FROZEN_ELEMENTS = LAYERS * WIDTH * WIDTH
TRAINABLE_ELEMENTS = LAYERS * 2 * RANK * WIDTH


def test_the_model_has_the_sizes_the_figures_count():
    model = make(True)
    assert frozen_elements(model) == FROZEN_ELEMENTS
    assert sum(p.numel() for p in model.parameters()) == FROZEN_ELEMENTS + TRAINABLE_ELEMENTS
    # Every parameter a multiple of 1024 elements (the partition figures below rely on it).
    assert all(p.numel() % 1024 == 0 for p in model.parameters())


@pytest.mark.parametrize("offload_param", ["none", "cpu"])
def test_stage_3_a_frozen_base_bf16_holds_keeps_no_fp32_master(offload_param):
    exact_bytes, exact, exact_drawn = run(True, 3, offload_param)
    drawn_bytes, drawn, fp32_drawn = run(False, 3, offload_param)
    check_same_draw(exact_drawn, fp32_drawn)
    # Each module is a group of its own and every parameter a multiple of 1024 elements, so at
    # world 1 the partition puts the base weights in sub-groups of frozen elements alone (the
    # adapters' runs, cut at 1024-element boundaries, already lie on them): each of those keeps
    # no master with the bf16 base and its whole master with the fp32 one. Nothing else differs
    # (with offload_param cpu the frozen shards are lent from the bf16 copy in both runs).
    assert drawn_bytes - exact_bytes == 4 * FROZEN_ELEMENTS
    for name in fp32_drawn:
        # What the engine gives of each base: the bf16 one exactly (widened from its bf16 copy),
        # the fp32 one's kept master.
        assert torch.equal(exact[name], exact_drawn[name].float()), name
        assert torch.equal(drawn[name], fp32_drawn[name]), name
    check_same_adapters(exact, drawn)


@pytest.mark.parametrize("exact_base", [True, False])
def test_stage_3_frozen_shards_in_host_memory_take_no_host_bytes(exact_base):
    # offload_param cpu adds the host shards of the adapters alone (2 bytes a bf16 element; at
    # world 1 a shard is its whole group, here 4,096 elements, so whole 4 KiB pages): the base's
    # shards are lent from the optimizer state's bf16 copy, whatever its values.
    on_device = run(exact_base, 3, "none")[0]
    in_host = run(exact_base, 3, "cpu")[0]
    assert in_host - on_device == 2 * TRAINABLE_ELEMENTS


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_and_2_the_frozen_base_costs_the_engine_nothing(stage):
    exact_bytes, exact, exact_drawn = run(True, stage, "none")
    drawn_bytes, drawn, fp32_drawn = run(False, stage, "none")
    check_same_draw(exact_drawn, fp32_drawn)
    # Stages 1 and 2 do not register a frozen parameter with the engine: what they keep in host
    # memory is the adapters' fp32 master, two moments and gradient accumulator (16 bytes an
    # element) and their bf16 copy (2), whichever the base.
    assert exact_bytes == drawn_bytes == 18 * TRAINABLE_ELEMENTS
    for name in fp32_drawn:
        # The module's bf16 tensor, the fp32 base rounded once at initialize().
        assert torch.equal(exact[name], exact_drawn[name].float()), name
        assert torch.equal(drawn[name], fp32_drawn[name].to(torch.bfloat16).float()), name
    check_same_adapters(exact, drawn)


def test_stage_3_frozen_elements_sharing_an_adapters_sub_group_keep_their_master_and_shard():
    # Two layers of width 200: each base 40,000 elements, each adapter 1,600. At world 1 every
    # module is a group of its own, padded to a multiple of 128 elements, so the partition is
    #   base 0 [0, 40064), lora_a 0 [40064, 41728), lora_b 0 [41728, 43392),
    #   base 1 [43392, 83456), lora_a 1 [83456, 85120), lora_b 1 [85120, 86784).
    # The adapters' runs widened to 1024-element boundaries are [39936, 44032) and [82944, 86784)
    # (the partition's end), so the sub-groups of frozen elements alone are [0, 39936) and
    # [44032, 82944): 39,936 + 38,912 = 78,848 of the 80,000 frozen elements keep no master with
    # the bf16 base. The other 1,152 share a sub-group with adapters, which keeps its master.
    width, layers = 200, 2
    for offload_param in ("none", "cpu"):
        exact_bytes, exact, exact_drawn = run(True, 3, offload_param, width, layers)
        drawn_bytes, drawn, fp32_drawn = run(False, 3, offload_param, width, layers)
        check_same_draw(exact_drawn, fp32_drawn, layers)
        assert drawn_bytes - exact_bytes == 4 * 78848
        for name in fp32_drawn:
            assert torch.equal(exact[name], exact_drawn[name].float()), name
            assert torch.equal(drawn[name], fp32_drawn[name]), name
        check_same_adapters(exact, drawn, width, layers)
    # Each base group has elements in an adapters' sub-group, so neither is lent: offload_param
    # cpu adds every group's host shard, each a whole number of 4 KiB pages (a base's 80,128
    # bytes take 81,920, an adapter's 3,328 take 4,096).
    for exact_base in (True, False):
        on_device = run(exact_base, 3, "none", width, layers)[0]
        in_host = run(exact_base, 3, "cpu", width, layers)[0]
        assert in_host - on_device == 2 * 81920 + 4 * 4096
