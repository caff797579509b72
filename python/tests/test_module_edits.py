"""What a script does to engine.module after initialize(): torch's load_state_dict() on it, its
parameters replaced, a frozen integer parameter. Each is either carried into the engine, as
plain torch would see it, or refused with a message that names the parameter and the way that
works."""
import pytest
import torch

import zinf.torch
from conftest import BETAS, EPS, WEIGHT_DECAY, train_mlp_zinf
from _helpers import mpirun, why_mpirun_unavailable

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


TWO_RANK_LOADS = """
import os, sys, torch, zinf.torch
from test_module_edits import batches, config, initial_state, loss_of, tied_net, train
torch.set_num_threads(1)
names = ("emb.weight", "a.weight", "a.bias")
for stage in (1, 2):
    model = tied_net()
    cfg = config(stage)
    cfg["zinf"]["collective_timeout_ms"] = 20000
    engine, _, _, _ = zinf.torch.initialize(model=model, config=cfg,
                                            model_parameters=model.parameters())
    rank = engine.global_rank
    data = batches(3)
    train(engine, data[:2])
    report = {"masters_before": {n: engine.read_parameter(n) for n in names},
              "module_before": {n: p.detach().clone() for n, p in model.named_parameters()}}
    try:
        engine.module.load_state_dict(initial_state())
        report["refused"] = None
    except NotImplementedError as error:
        report["refused"] = str(error)
    try:
        engine.module.a.load_state_dict({"weight": initial_state()["a.weight"],
                                         "bias": initial_state()["a.bias"]})
        report["submodule_refused"] = None
    except NotImplementedError as error:
        report["submodule_refused"] = str(error)
    # A block lets through the load of the parameters it was given only: rank 0's load of the
    # whole model inside a block of a's is refused, and the block's end writes nothing.
    try:
        with zinf.torch.GatheredParameters([model.a.weight, model.a.bias], modifier_rank=0):
            if rank == 0:
                engine.module.load_state_dict(initial_state())
        report["outside_the_block_refused"] = None
    except NotImplementedError as error:
        report["outside_the_block_refused"] = str(error)
    report["masters_after_refusal"] = {n: engine.read_parameter(n) for n in names}
    report["module_after_refusal"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    # The way the message names: rank 0 loads inside the block, whose end writes its values on
    # every rank.
    with zinf.torch.GatheredParameters(list(model.parameters()), modifier_rank=0):
        if rank == 0:
            engine.module.load_state_dict(initial_state())
    report["masters_after_block"] = {n: engine.read_parameter(n) for n in names}
    report["module_after_block"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    # The block is over: a load outside one is refused again.
    try:
        engine.module.load_state_dict(initial_state())
        report["refused_after_block"] = None
    except NotImplementedError as error:
        report["refused_after_block"] = str(error)
    report["next_losses"] = train(engine, data[2:])
    report["masters_after_step"] = {n: engine.read_parameter(n) for n in names}
    torch.save(report, os.path.join(sys.argv[1], f"stage{stage}.rank{rank}.pt"))
    engine.destroy()
"""


def test_load_state_dict_on_two_ranks_is_refused_outside_a_modifier_block(tmp_path):
    """Stages 1 and 2 on two ranks (mpirun): engine.module.load_state_dict() (or a submodule's)
    outside GatheredParameters(modifier_rank=r), or of a parameter the open block was not
    given, is refused before anything is copied, naming the parameter, the stage, the world size
    and the block (it used to change the rank's forward only, and the next step wrote the old
    masters back over it); inside a block of every parameter, loaded on rank 0 only, it reaches
    the masters and forward of every rank, and the next step trains from the loaded values."""
    if why_mpirun_unavailable() is not None:
        pytest.skip(why_mpirun_unavailable())
    result = mpirun("-c", [TWO_RANK_LOADS, tmp_path], timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    loaded = initial_state()
    # One step from the loaded weights on the third batch, as plain torch computes its loss (each
    # rank ran the same batch, so the mean gradient is that batch's).
    expected_loss = loss_of(tied_net(), batches(3)[2]).item()
    for stage in (1, 2):
        reports = [torch.load(tmp_path / f"stage{stage}.rank{rank}.pt") for rank in (0, 1)]
        for rank, report in enumerate(reports):
            where = f"stage {stage}, rank {rank}"
            for key in ("refused", "refused_after_block"):
                assert report[key] is not None, (where, key)
                assert (f"parameter 'emb.weight' is trained by the zinf engine at ZeRO stage "
                        f"{stage} on 2 ranks" in report[key]), (where, report[key])
                assert ("GatheredParameters(list(model.parameters()), modifier_rank=0)"
                        in report[key]), (where, report[key])
            assert report["submodule_refused"] is not None, where
            assert "parameter 'weight'" in report["submodule_refused"], where
            if rank == 0:
                assert "parameter 'emb.weight'" in report["outside_the_block_refused"], where
            else:
                assert report["outside_the_block_refused"] is None, where
            # Refused before torch copied anything: the forward's tensors and the masters are
            # as they were, and they are not the values offered.
            for name in report["module_before"]:
                assert torch.equal(report["module_after_refusal"][name],
                                   report["module_before"][name]), (where, name)
            for name in report["masters_before"]:
                assert torch.equal(report["masters_after_refusal"][name],
                                   report["masters_before"][name]), (where, name)
                assert not torch.equal(report["masters_before"][name], loaded[name]), (where, name)
                # Inside the block, rank 0's load reached every rank's masters and forward.
                assert torch.equal(report["masters_after_block"][name], loaded[name]), (where,
                                                                                       name)
                assert torch.equal(report["module_after_block"][name], loaded[name]), (where,
                                                                                      name)
            assert report["next_losses"][0] == pytest.approx(expected_loss, rel=1e-6), where
            for name, master in report["masters_after_step"].items():
                assert not torch.equal(master, loaded[name]), (where, name)
                assert torch.equal(master, reports[0]["masters_after_step"][name]), (where, name)


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
