"""Activations through the engine's store (docs/ACTIVATIONS.md): zinf.torch.checkpoint against
torch.utils.checkpoint.checkpoint on transformers GPT-2 blocks, and zinf.torch.offload_saved_tensors
against no offload on the small GPT-2 of the other tests, with the store's NVMe counters checked
against the bytes autograd saved; errors name the activation."""
import json

import pytest
import torch
import torch.utils.checkpoint
from conftest import make_batches, make_model, zinf_config
from transformers import GPT2Config
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

import zinf.torch
from zinf import _zinf

WIDTH, HEADS, SEQUENCE, BATCH = 64, 4, 32, 4
SWAP_BLOCK = 4096  # the activation swap file's unit: each key's extent is its bytes rounded up


def bare_engine(tmp_path=None, host_bytes=0, nvme_bytes=64 << 20):
    """An engine used for its activation store only: one small parameter, finalized (for its
    memory report). With tmp_path the store's NVMe tier is there, beyond `host_bytes` of arena."""
    zinf_section = {"cpu_threads": 1, "activation_host_bytes": host_bytes}
    if tmp_path is not None:
        zinf_section["activation_nvme_path"] = str(tmp_path / "activations")
        zinf_section["activation_nvme_bytes"] = nvme_bytes
    config = {"zero_optimization": {"stage": 1},
              "activation_checkpointing": {"cpu_checkpointing": True},
              "zinf": zinf_section}
    core = _zinf.Engine(json.dumps(config))
    core.register_parameter("w", "m", [4], "f32", torch.arange(4, dtype=torch.float32))
    with pytest.raises(_zinf.Error, match="not finalized"):
        core.memory()  # sized at finalize: refused before, not an assertion
    core.finalize()
    return core


def make_blocks(count=2, seed=5):
    config = GPT2Config(n_embd=WIDTH, n_head=HEADS, n_positions=SEQUENCE, attn_pdrop=0.1,
                        resid_pdrop=0.1)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return [GPT2Block(config, layer_idx=i).train() for i in range(count)]


def block_gradients(blocks, run_block):
    """Gradients of a fixed random projection of two chained blocks' output, with respect to the
    input and every parameter; `run_block(block, h)` runs one block (checkpointed or not)."""
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(BATCH, SEQUENCE, WIDTH, generator=generator, requires_grad=True)
    weight = torch.randn(BATCH, SEQUENCE, WIDTH, generator=generator)
    for block in blocks:
        block.zero_grad(set_to_none=True)
    torch.manual_seed(7)  # dropout: the same masks in every variant (checkpoint replays them)
    h = x
    for block in blocks:
        h = run_block(block, h)
    (h * weight).sum().backward()
    grads = {"input": x.grad}
    for i, block in enumerate(blocks):
        for name, param in block.named_parameters():
            grads[f"{i}.{name}"] = param.grad
    return grads


def test_checkpoint_matches_torch_checkpoint_with_inputs_on_nvme(tmp_path):
    blocks = make_blocks()
    reference = block_gradients(
        blocks, lambda b, h: torch.utils.checkpoint.checkpoint(b, h, use_reentrant=False))
    core = bare_engine(tmp_path)
    got = block_gradients(blocks, lambda b, h: zinf.torch.checkpoint(b, h, engine=core))
    assert got.keys() == reference.keys()
    for name, ref in reference.items():
        assert ref is not None and got[name] is not None, name
        torch.testing.assert_close(got[name], ref, rtol=1e-6, atol=0, msg=name)
    # The store held exactly the blocks' inputs: no arena, so both went to NVMe and back.
    memory = core.memory()
    input_bytes = BATCH * SEQUENCE * WIDTH * 4
    assert input_bytes % SWAP_BLOCK == 0
    assert memory["activation_nvme_write_bytes"] == len(blocks) * input_bytes
    assert memory["activation_nvme_read_bytes"] <= len(blocks) * input_bytes
    plain = block_gradients(blocks, lambda b, h: b(h))
    for name, ref in plain.items():
        torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-6, msg=name)


def saved_bytes_of(model, ids):
    """What autograd saves in a forward pass, by plain torch hooks: the bytes of every tensor
    offload_saved_tensors takes (not parameters, not empty), each rounded to the swap block."""
    sizes = []

    def pack(tensor):
        is_param = isinstance(tensor, torch.nn.Parameter) or isinstance(
            tensor._base, torch.nn.Parameter)
        if tensor.numel() and not is_param:
            sizes.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(-(-b // SWAP_BLOCK) * SWAP_BLOCK for b in sizes), len(sizes)


def model_gradients(model, ids, offload=None):
    model.zero_grad(set_to_none=True)
    if offload is None:
        loss = model(input_ids=ids, labels=ids).loss
    else:
        with offload:
            loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_offloaded_saved_tensors_give_the_same_gradient_bits(tmp_path):
    model = make_model()
    generator = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 256, (BATCH, SEQUENCE), generator=generator) for _ in range(2)]
    core = bare_engine(tmp_path)
    expected_bytes, saved_count = saved_bytes_of(model, batches[0])
    assert saved_count > 20
    for step, ids in enumerate(batches):
        loss, reference = model_gradients(model, ids)
        got_loss, got = model_gradients(model, ids, zinf.torch.offload_saved_tensors(core))
        assert torch.equal(got_loss, loss)
        for name, ref in reference.items():
            assert torch.equal(got[name], ref), f"step {step}: {name}"
        # Every saved tensor went to NVMe (no arena) under the same keys each step.
        memory = core.memory()
        assert memory["activation_nvme_write_bytes"] == (step + 1) * expected_bytes
        assert 0 < memory["activation_nvme_read_bytes"] <= (step + 1) * expected_bytes


def test_host_arena_offload_and_a_full_arena_names_the_activation():
    model = make_model()
    ids = torch.randint(0, 256, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(4))
    _, reference = model_gradients(model, ids)
    core = bare_engine(host_bytes=16 << 20)
    _, got = model_gradients(model, ids, zinf.torch.offload_saved_tensors(core))
    for name, ref in reference.items():
        assert torch.equal(got[name], ref), name
    assert core.memory()["activation_host_bytes"] >= 16 << 20
    assert core.memory()["activation_nvme_write_bytes"] == 0

    small = bare_engine(host_bytes=64 << 10)  # no NVMe tier: the arena fills during forward
    with pytest.raises(zinf.torch.Error, match=r"saved_tensor\.\d+\.\d+.*activation_host_bytes"):
        with zinf.torch.offload_saved_tensors(small):
            model(input_ids=ids, labels=ids)


def test_a_closed_store_fails_the_backward_naming_the_activation():
    model = make_model()
    ids = torch.randint(0, 256, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(6))
    core = bare_engine(host_bytes=16 << 20)
    with zinf.torch.offload_saved_tensors(core):
        loss = model(input_ids=ids, labels=ids).loss
    core.close()
    with pytest.raises(RuntimeError, match=r"saved tensor 'saved_tensor\.\d+\.\d+'.*closed"):
        loss.backward()


def train_stage3(tmp_path, steps, offload):
    """The example's GPT-2 trained `steps` steps by a stage-3 zinf.torch engine (its own
    saved-tensor hooks rebuild parameter views), the forward passes inside
    offload_saved_tensors when `offload`. Returns the losses, the final masters and the engine's
    memory report."""
    config = zinf_config(3, "cpu", "cpu", tmp_path, stage3_param_persistence_threshold=0)
    config["activation_checkpointing"] = {"cpu_checkpointing": True}
    config["zinf"]["activation_host_bytes"] = 16 << 20
    model = make_model()
    engine, _, _, _ = zinf.torch.initialize(model=model, config=config)
    losses = []
    for ids, labels in make_batches(steps):
        if offload:
            with zinf.torch.offload_saved_tensors(engine):
                loss = engine(input_ids=ids, labels=labels).loss
        else:
            loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    masters = {name: engine.read_parameter(name) for name, _ in model.named_parameters()}
    memory = engine.memory()
    engine.destroy()
    return losses, masters, memory


def test_offload_inside_a_stage3_engine_trains_the_same_bits(tmp_path):
    losses, masters, memory = train_stage3(tmp_path / "plain", 3, offload=False)
    assert memory["activation_host_bytes"] == 0  # the store never opened
    got_losses, got_masters, got_memory = train_stage3(tmp_path / "offload", 3, offload=True)
    assert got_losses == losses
    for name, master in masters.items():
        assert torch.equal(got_masters[name], master), name
    assert got_memory["activation_host_bytes"] >= 16 << 20
