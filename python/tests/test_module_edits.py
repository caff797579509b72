"""What a script does to engine.module after initialize(): torch's load_state_dict() on it, its
parameters replaced, a frozen integer parameter. Each is either carried into the engine, as
plain torch would see it, or refused with a message that names the parameter and the way that
works."""
import pytest
import torch

import zinf.torch
from conftest import BETAS, EPS, WEIGHT_DECAY, train_mlp_zinf

LR = 1e-2


class TiedNet(torch.nn.Module):
    """An embedding whose weight the output layer shares (tied, as GPT-2's), between them a
    linear layer."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.a = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.a(self.emb(ids))))


def tied_net():
    torch.manual_seed(3)
    return TiedNet()


def batches(count, seed=4):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 10, (4,), generator=generator),
             torch.randint(0, 10, (4,), generator=generator)) for _ in range(count)]


def loss_of(model, batch):
    ids, labels = batch
    return torch.nn.functional.cross_entropy(model(ids), labels)


def config(stage):
    return {"train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                      "weight_decay": WEIGHT_DECAY}},
            "zero_optimization": {"stage": stage,
                                  **({"stage3_param_persistence_threshold": 0}
                                     if stage == 3 else {})},
            "zinf": {"cpu_threads": 1}}


def train(engine, data):
    return train_mlp_zinf(engine, data, loss_of)


def initial_state():
    """The weights the models start from, as a state dict of new tensors (both names of the tied
    weight, as torch's state_dict() has them)."""
    return {name: value.clone() for name, value in tied_net().state_dict().items()}


@pytest.mark.parametrize("stage", [1, 2])
def test_load_state_dict_reaches_the_masters_and_the_next_step(stage):
    # Plain torch: two steps, the initial weights loaded back, one more step (AdamW's moments
    # are kept across the load, as the engine's are).
    data = batches(3)
    reference = tied_net()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                  weight_decay=WEIGHT_DECAY)
    expected = []
    for index, batch in enumerate(data):
        if index == 2:
            reference.load_state_dict(initial_state())
        loss = loss_of(reference, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())

    model = tied_net()
    engine, _, _, _ = zinf.torch.initialize(model=model, config=config(stage),
                                            model_parameters=model.parameters())
    losses = train(engine, data[:2])
    loaded = initial_state()
    engine.module.load_state_dict(loaded)
    # The fp32 masters are the loaded values, not only the forward's copy.
    for name in ("emb.weight", "a.weight", "a.bias"):
        assert torch.equal(engine.read_parameter(name), loaded[name]), name
    # One step from the same weights as an engine that starts there: the same loss.
    fresh_model = tied_net()
    fresh, _, _, _ = zinf.torch.initialize(model=fresh_model, config=config(stage),
                                           model_parameters=fresh_model.parameters())
    losses += train(engine, data[2:])
    assert train(fresh, data[2:]) == losses[2:]
    assert losses == pytest.approx(expected, rel=1e-5)
    # And the step that followed updated the loaded weights, as torch's did (before, the step
    # wrote the old master plus its update back over them).
    for name, param in reference.named_parameters():
        assert torch.allclose(engine.read_parameter(name), param.detach(), rtol=1e-5,
                              atol=1e-6), name


def test_load_state_dict_of_a_submodule_reaches_its_masters():
    model = tied_net()
    engine, _, _, _ = zinf.torch.initialize(model=model, config=config(2),
                                            model_parameters=model.parameters())
    train(engine, batches(2))
    generator = torch.Generator().manual_seed(7)
    values = {"weight": torch.randn(8, 8, generator=generator),
              "bias": torch.randn(8, generator=generator)}
    untouched = engine.read_parameter("emb.weight")
    engine.module.a.load_state_dict(values)
    assert torch.equal(engine.read_parameter("a.weight"), values["weight"])
    assert torch.equal(engine.read_parameter("a.bias"), values["bias"])
    assert torch.equal(engine.read_parameter("emb.weight"), untouched)
    assert torch.equal(engine.module.a.weight.detach(), values["weight"])


def test_load_state_dict_at_stage_3_is_refused_naming_the_way_that_works():
    model = tied_net()
    engine, _, _, _ = zinf.torch.initialize(model=model, config=config(3),
                                            model_parameters=model.parameters())
    before = engine.read_parameter("a.weight")
    loaded = initial_state()
    with pytest.raises(NotImplementedError, match=r"'emb\.weight'.*GatheredParameters"):
        engine.module.load_state_dict(loaded)
    assert torch.equal(engine.read_parameter("a.weight"), before)
    # What the message points to: the load inside GatheredParameters(modifier_rank=0).
    train(engine, batches(1))
    with zinf.torch.GatheredParameters(list(model.parameters()), modifier_rank=0):
        engine.module.load_state_dict(loaded)
    for name in ("emb.weight", "a.weight", "a.bias"):
        assert torch.equal(engine.read_parameter(name), loaded[name]), name


def test_the_optimizers_state_dict_is_refused_naming_the_engines_checkpoint():
    model = tied_net()
    engine, optimizer, _, _ = zinf.torch.initialize(model=model, config=config(2),
                                                    model_parameters=model.parameters())
    train(engine, batches(2))
    with pytest.raises(NotImplementedError, match=r"engine\.save_checkpoint"):
        optimizer.state_dict()
    # A torch AdamW's dict, moments and all, with another lr: refused, nothing taken from it.
    reference = tied_net()
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    loss_of(reference, batches(1)[0]).backward()
    torch_optimizer.step()
    state = torch_optimizer.state_dict()
    state["param_groups"][0]["lr"] = 0.5
    with pytest.raises(NotImplementedError, match=r"engine\.load_checkpoint"):
        optimizer.load_state_dict(state)
    assert engine.get_lr() == [LR]


class PermutedNet(torch.nn.Module):
    """A linear layer whose outputs a frozen integer parameter permutes (an index, as a model
    may keep a token or channel order)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.w = torch.nn.Linear(4, 4)
        self.perm = torch.nn.Parameter(torch.tensor([3, 1, 2, 0]), requires_grad=False)

    def forward(self, x):
        return self.w(x)[:, self.perm]


@pytest.mark.parametrize("stage", [1, 2])
def test_a_frozen_integer_parameter_keeps_its_dtype(stage):
    reference = PermutedNet()
    model = PermutedNet()
    engine, _, _, _ = zinf.torch.initialize(model=model, config=config(stage),
                                            model_parameters=model.parameters())
    assert model.perm.dtype == torch.int64
    assert model.perm.tolist() == [3, 1, 2, 0]
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(6))
    out = engine(x)
    assert torch.allclose(out, reference(x), rtol=1e-6, atol=1e-7)
    engine.backward(out.pow(2).mean())
    engine.step()
    assert model.perm.dtype == torch.int64


def test_a_frozen_integer_parameter_is_refused_at_stage_3_naming_it():
    model = PermutedNet()
    with pytest.raises(NotImplementedError, match=r"parameter 'perm' has dtype torch\.int64"):
        zinf.torch.initialize(model=model, config=config(3), model_parameters=model.parameters())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_parameter_replaced_after_initialize_is_refused_at_the_next_backward(stage):
    model = tied_net()
    engine, _, _, _ = zinf.torch.initialize(model=model, config=config(stage),
                                            model_parameters=model.parameters())
    data = batches(2)
    train(engine, data[:1])
    generator = torch.Generator().manual_seed(8)
    model.a.weight = torch.nn.Parameter(torch.randn(8, 8, generator=generator))
    loss = loss_of(engine, data[1])
    with pytest.raises(RuntimeError, match=r"parameter 'a\.weight' was added to the model or "
                                           r"replaced after initialize\(\)"):
        engine.backward(loss)


def test_a_parameter_added_after_initialize_is_refused_and_a_frozen_one_is_not():
    model = tied_net()
    engine, _, _, _ = zinf.torch.initialize(model=model, config=config(2),
                                            model_parameters=model.parameters())
    data = batches(3)
    model.mask = torch.nn.Parameter(torch.ones(10), requires_grad=False)
    train(engine, data[:1])
    model.scale = torch.nn.Parameter(torch.ones(10))
    loss = (engine(data[1][0]) * model.scale).mean()
    with pytest.raises(RuntimeError, match=r"parameter 'scale' was added"):
        engine.backward(loss)


def test_a_tensor_in_model_parameters_that_is_not_the_models_is_named_by_index_and_shape():
    model = tied_net()
    stranger = torch.nn.Parameter(torch.zeros(3, 5))
    with pytest.raises(ValueError, match=r"parameter group 0: its parameter 3 \(shape \(3, 5\)\) "
                                         r"is not one of the model's"):
        zinf.torch.initialize(model=model, config=config(2),
                              model_parameters=list(model.parameters()) + [stranger])


@pytest.mark.parametrize("stage", [2, 3])
def test_read_parameter_of_a_tied_alias_returns_the_shared_master(stage):
    model = tied_net()
    engine, _, _, _ = zinf.torch.initialize(model=model, config=config(stage),
                                            model_parameters=model.parameters())
    train(engine, batches(2))
    shared = engine.read_parameter("emb.weight")
    assert torch.equal(engine.read_parameter("out.weight"), shared)
    with pytest.raises(KeyError, match="no parameter 'out.bias'"):
        engine.read_parameter("out.bias")
