"""Stage 3 through module hooks: parameters exist only while their module is gathered, the
backward gathers them again, gradients are handed over and freed as autograd makes them, and
live parameters stay within stage3_max_live_parameters."""
import math

import pytest
import torch

import zinf.torch
from conftest import (BETAS, CLIP, EPS, LR, WEIGHT_DECAY, assert_mlp_matches, make_batches,
                      make_mlp, make_model, mlp_batches, mlp_config, train_mlp_torch,
                      train_mlp_zinf, train_zinf, zinf_config)


def open_stage3(tmp_path, **zero):
    model = make_model()
    config = zinf_config(3, "cpu", "cpu", tmp_path, stage3_param_persistence_threshold=0, **zero)
    engine, _, _, _ = zinf.torch.initialize(model=model, config=config,
                                            model_parameters=model.parameters())
    return engine, model


def test_parameters_are_placeholders_outside_their_module(tmp_path):
    engine, model = open_stage3(tmp_path)
    seen = {}

    def record(module, inputs):
        seen[module] = [p.numel() for p in module.parameters(recurse=False)]

    handles = [m.register_forward_pre_hook(record) for m in model.modules()
               if list(m.parameters(recurse=False))]
    ids, labels = make_batches(1)[0]
    loss = engine(input_ids=ids, labels=labels).loss
    # Inside its forward every module saw its full parameters (hooks run after zinf's) ...
    for module, counts in seen.items():
        assert counts == [math.prod(engine._shapes[id(p)]) for p in engine._uses[module]]
    # ... and after the forward every parameter is an empty placeholder again.
    assert all(p.numel() == 0 for p in model.parameters())
    engine.backward(loss)
    assert all(p.numel() == 0 and p.grad is None for p in model.parameters())
    assert engine.counters()["live_elements"] == 0
    for h in handles:
        h.remove()


def test_gradients_are_freed_as_they_are_handed_over(tmp_path):
    engine, model = open_stage3(tmp_path)
    params = list(model.parameters())
    total = sum(math.prod(engine._shapes[id(p)]) for p in params)
    live = []

    def count(_):
        live.append(sum(p.grad.numel() for p in params if p.grad is not None))

    # Registered after zinf's hooks, so each runs once zinf has handed that gradient over.
    for p in params:
        p.register_post_accumulate_grad_hook(count)
    ids, labels = make_batches(1)[0]
    engine.backward(engine(input_ids=ids, labels=labels).loss)
    assert len(live) == len(params)
    # Without the hand-over every gradient would be alive at the end (120,576 elements); with
    # it, at most one module's gradients wait for their siblings.
    assert max(live) <= 64 * 256, live
    assert max(live) < total / 4


def test_live_parameters_stay_within_max_live(tmp_path, torch_reference):
    # Room for the largest module (the 256 x 64 embedding) and a little more: the engine frees
    # and reuses gathered memory constantly, so a saved tensor still pointing at released memory
    # would change the losses.
    max_live = 256 * 64 + 64 * 256 + 256
    engine, _ = open_stage3(tmp_path, stage3_max_live_parameters=max_live)
    steps = 6
    losses = train_zinf(engine, make_batches(steps))
    assert losses == pytest.approx(torch_reference[0][:steps], rel=1e-5)
    counters = engine.counters()
    assert 0 < counters["live_elements_peak"] <= max_live
    assert counters["prefetch_hits"] > 0


def test_eval_forward_gathers_and_releases_without_a_graph(tmp_path):
    engine, model = open_stage3(tmp_path)
    ids, labels = make_batches(1)[0]
    with torch.no_grad():
        loss = engine(input_ids=ids, labels=labels).loss
    reference = make_model()
    with torch.no_grad():
        expected = reference(input_ids=ids, labels=labels).loss
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert engine.counters()["live_elements"] == 0


def test_a_model_in_eval_mode_trains_as_torch(tmp_path):
    """eval() turns dropout off; autograd still records, so the backward gathers as in training
    mode (DeepSpeed trains in eval mode too)."""
    batches = mlp_batches(3)
    reference = make_mlp(dropout=0.5).eval()
    expected = train_mlp_torch(reference, batches)
    model = make_mlp(dropout=0.5)
    engine, _, _, _ = zinf.torch.initialize(model=model, config=mlp_config(3, "cpu", tmp_path))
    engine.eval()
    assert not model.training
    assert train_mlp_zinf(engine, batches) == pytest.approx(expected, rel=1e-5)
    assert_mlp_matches(engine, reference)
    assert engine.counters()["live_elements"] == 0


def saved_tensors(loss):
    """Every tensor autograd saved for the backward of loss, as autograd would unpack it now
    (None where unpacking fails)."""
    seen, stack, found = set(), [loss.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for attr in dir(node):
            if attr.startswith("_saved_"):
                try:
                    value = getattr(node, attr)
                except RuntimeError:
                    value = None
                if isinstance(value, torch.Tensor):
                    found.append(value)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def test_autograd_keeps_no_view_of_released_memory(tmp_path):
    # The output projection is an nn.Linear: its matmul saves weight.t(), a view of the gathered
    # (tied) embedding. Saved as-is it would point at memory the engine has released and may
    # have reused by the time the backward reads it.
    engine, model = open_stage3(tmp_path)
    gathered = []

    def record(module, inputs):
        for p in module.parameters(recurse=False):
            gathered.append((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()))

    for m in model.modules():
        if list(m.parameters(recurse=False)):
            m.register_forward_pre_hook(record)
    ids, labels = make_batches(1)[0]
    loss = engine(input_ids=ids, labels=labels).loss
    aliasing = [t.shape for t in saved_tensors(loss)
                if t.numel() and any(lo <= t.data_ptr() < hi for lo, hi in gathered)]
    assert not aliasing
    engine.backward(loss)


def test_gathered_parameters_shows_the_trained_values(tmp_path):
    engine, model = open_stage3(tmp_path)
    train_zinf(engine, make_batches(3))
    with zinf.torch.GatheredParameters(model.parameters()):
        for name, param in model.named_parameters():
            assert torch.equal(param.detach(), engine.read_parameter(name)), name
    assert all(p.numel() == 0 for p in model.parameters())
    assert engine.counters()["live_elements"] == 0
    # Training goes on after it, with its prefetch order intact.
    train_zinf(engine, make_batches(1, seed=9))
    assert engine.counters()["live_elements"] == 0


class _TiedOutput(torch.nn.Module):
    """Uses its child's weight in its own forward (an output layer tied to an embedding)."""

    def __init__(self, register: bool):
        super().__init__()
        self.embed = torch.nn.Linear(4, 8)
        self.bias = torch.nn.Parameter(torch.zeros(4))
        if register:
            zinf.torch.zero.register_external_parameter(self, self.embed.weight)

    def forward(self, x):
        return torch.nn.functional.linear(torch.tanh(self.embed(x)), self.embed.weight.t(),
                                          self.bias)


def test_an_external_parameter_is_gathered_where_it_is_registered():
    """DeepSpeed's register_external_parameter: the parent's forward gathers the child's weight
    it uses; without it, torch's shape error carries a note saying what to do."""
    torch.manual_seed(0)
    reference = _TiedOutput(register=False)
    config = mlp_config(3)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                  weight_decay=WEIGHT_DECAY)
    torch.manual_seed(0)
    engine, _, _, _ = zinf.torch.initialize(model=_TiedOutput(register=True), config=config)
    generator = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(2, 4, generator=generator)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        reference(x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
    for name, expected in reference.named_parameters():
        assert torch.allclose(engine.read_parameter(name), expected.detach(), rtol=1e-5,
                              atol=1e-7), name

    torch.manual_seed(0)
    unregistered, _, _, _ = zinf.torch.initialize(model=_TiedOutput(register=False),
                                                  config=config)
    with pytest.raises(RuntimeError) as raised:
        unregistered(torch.randn(2, 4))
    assert any("register_external_parameter(module, parameter)" in note
               for note in getattr(raised.value, "__notes__", [])), raised.value
    # The forward the error cut short holds no gather.
    assert not any(unregistered._gather_count.values()), unregistered._gather_count
    # Registered on the engine's model after initialize(): gathered from the next forward on.
    model = unregistered.module
    zinf.torch.zero.register_external_parameter(model, model.embed.weight)
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert unregistered(x).shape == (2, 4)
    zinf.torch.zero.unregister_external_parameter(model, model.embed.weight)
    with pytest.raises(RuntimeError):
        unregistered(x)


def test_hf_gradient_checkpointing_trains_as_torch_does(torch_reference):
    """Hugging Face's activation checkpointing (gradient_checkpointing_enable() before
    transformers 5.x: torch's non-reentrant checkpoint, which by default stops its recomputation
    early once the backward has what it needs) at stage 3, every parameter sharded and the
    gathers prefetched: the same bits as without checkpointing (the recomputation's saved values
    are the gathered buffers, kept until the module's backward), and training as torch's."""
    def train(checkpointing):
        model = make_model()
        if checkpointing and hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable({"use_reentrant": False})
        elif checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        engine, _, _, _ = zinf.torch.initialize(
            model=model, config=zinf_config(3, stage3_param_persistence_threshold=0))
        losses = train_zinf(engine, make_batches())
        masters = {name: engine.read_parameter(name) for name in torch_reference[1]}
        engine.destroy()
        return losses, masters

    losses, masters = train(checkpointing=False)
    got_losses, got_masters = train(checkpointing=True)
    assert got_losses == losses
    for name, master in masters.items():
        assert torch.equal(got_masters[name], master), name
    assert got_losses == pytest.approx(torch_reference[0], rel=1e-5)
