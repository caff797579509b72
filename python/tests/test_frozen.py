"""Frozen parameters (requires_grad False) at ZeRO stages 1-3: against plain torch, whose
AdamW and clip_grad_norm_ see the trainable parameters only, the engine trains the same
trajectory; frozen weights stay in the compute dtype, bit for bit (at stage 3 they are engine
parameters registered frozen: their masters and gathered copies keep their bits); checkpoints
keep them and resume bit-identically; state dicts hold them unless exclude_frozen_parameters.
With two ranks (mpirun, torchrun) at stages 1 and 2, every rank takes rank 0's frozen weights at
initialize() and at load_checkpoint()."""
import gc
import json
import os
import subprocess
import sys
import textwrap
import warnings
import weakref

import pytest
import torch
from torch import nn

import zinf.torch
from _helpers import mpirun, torchrun, why_mpirun_unavailable, why_torchrun_unavailable
from conftest import BETAS, EPS, LR, WEIGHT_DECAY, zinf_config

# Small enough that the clipping acts at every step of these problems (checked below).
CLIP = 0.05
STEPS = 6


class LoraLinear(nn.Module):
    """A frozen Linear plus a trainable low-rank update, as LoRA adapters are: base(x) + x A^T
    B^T."""

    def __init__(self, features_in, features_out, rank=2):
        super().__init__()
        self.base = nn.Linear(features_in, features_out)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, features_in) * 0.3)
        self.lora_b = nn.Parameter(torch.randn(features_out, rank) * 0.3)

    def forward(self, x):
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


class FrozenEmbedding(nn.Module):
    """A frozen embedding under a trainable head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.embed.weight.requires_grad_(False)
        self.head = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.LayerNorm(16), nn.Linear(16, 3))

    def forward(self, ids):
        return self.head(self.embed(ids).mean(dim=1))


class Lora(nn.Module):
    """A frozen backbone of two Linears, each with a trainable adapter, and a trainable head."""

    def __init__(self):
        super().__init__()
        self.first = LoraLinear(6, 16)
        self.second = LoraLinear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.second(torch.tanh(self.first(x)))))


class Mixed(nn.Module):
    """A Linear whose weight is frozen and whose bias trains (one torch module, two engine
    modules at stage 3), under a trainable head."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(6, 16)
        self.first.weight.requires_grad_(False)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.first(x)))


MODELS = {"embedding": FrozenEmbedding, "lora": Lora, "mixed": Mixed}


def make(kind, seed=21):
    torch.manual_seed(seed)
    return MODELS[kind]()


def batches(kind, count=STEPS, seed=22):
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        if kind == "embedding":
            x = torch.randint(0, 16, (4, 5), generator=generator)
        else:
            x = torch.randn(4, 6, generator=generator)
        out.append((x, torch.randn(4, 3, generator=generator) * 3))
    return out


def loss_of(model, batch):
    """The mean squared error, the inputs in the model's dtype (bf16 where it computes in it)."""
    x, y = batch
    if x.is_floating_point():
        x = x.to(next(model.parameters()).dtype)
    return (model(x).float() - y).pow(2).mean()


def config(stage, bf16=False):
    c = zinf_config(stage, bf16=bf16)
    c["gradient_clipping"] = CLIP
    return c


def frozen_of(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


def train_torch(model, data, groups=None):
    """Plain torch: AdamW over the parameters that require grad (or over `groups` of them),
    their norm clipped to CLIP. Returns the losses and the norms before clipping."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable if groups is None else groups, lr=LR, betas=BETAS,
                                  eps=EPS, weight_decay=WEIGHT_DECAY)
    losses, norms = [], []
    for batch in data:
        loss = loss_of(model, batch)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(trainable, CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms


def train_zinf(engine, data):
    losses, norms = [], []
    for batch in data:
        loss = loss_of(engine, batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
    return losses, norms


def open_engine(model, stage, bf16=False, model_parameters=None):
    engine, _, _, _ = zinf.torch.initialize(
        model=model, config=config(stage, bf16),
        model_parameters=model.parameters() if model_parameters is None else model_parameters)
    return engine


def trainable_names(model):
    return [n for n, p in model.named_parameters() if p.requires_grad]


def gathered_frozen(model, frozen):
    """Stage 3: the frozen parameters' gathered values (GatheredParameters), by name."""
    params = [p for n, p in model.named_parameters() if n in frozen]
    with zinf.torch.GatheredParameters(params):
        return {n: p.detach().clone() for n, p in model.named_parameters() if n in frozen}


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp32_trains_the_trainable_parameters_as_torch_adamw(kind, stage):
    reference = make(kind)
    frozen = frozen_of(reference)
    want_losses, want_norms = train_torch(reference, batches(kind))
    assert min(want_norms) > CLIP  # the clipping acts at every step

    model = make(kind)
    engine = open_engine(model, stage)
    losses, norms = train_zinf(engine, batches(kind))
    assert losses == pytest.approx(want_losses, rel=1e-5)
    # The global norm counts the trainable parameters only, as DeepSpeed's.
    assert norms == pytest.approx(want_norms, rel=1e-5)
    for name, expected in reference.named_parameters():
        if name in frozen:
            continue
        got = engine.read_parameter(name)
        error = ((got - expected.detach()).norm() / expected.detach().norm()).item()
        assert error < 1e-5, f"{name}: relative error {error:.2e}"
    # Frozen weights: unchanged to the bit, never handed a gradient; the module's own tensors
    # (stages 1, 2), or engine parameters whose masters and gathered copies keep their bits
    # (stage 3, after steps with weight decay).
    gathered = gathered_frozen(model, frozen) if stage == 3 else dict(model.named_parameters())
    for name, param in model.named_parameters():
        if name in frozen:
            assert not param.requires_grad and param.grad is None
            value = gathered[name]
            assert value.dtype == torch.float32 and torch.equal(value, frozen[name]), name
            assert torch.equal(engine.read_parameter(name), frozen[name])
    # The optimizer holds the trainable parameters only.
    held = [p for g in engine.optimizer.param_groups for p in g["params"]]
    assert sorted(id(p) for p in held) == sorted(
        id(p) for p in model.parameters() if p.requires_grad)


def bf16_reference(model, data):
    """torch in zinf's mixed precision: the model in bf16, fp32 masters of the trainable
    parameters stepped by AdamW on the bf16 gradients (fp32), clipped over the masters, then
    rounded into the model."""
    model = model.to(torch.bfloat16)
    trainable = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone().requires_grad_(True) for p in trainable]
    optimizer = torch.optim.AdamW(masters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    losses = []
    for batch in data:
        loss = loss_of(model, batch)
        loss.backward()
        for master, p in zip(masters, trainable):
            master.grad = p.grad.float()
            p.grad = None
        torch.nn.utils.clip_grad_norm_(masters, CLIP)
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for master, p in zip(masters, trainable):
                p.copy_(master)
        losses.append(loss.item())
    return losses, model


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_keeps_frozen_weights_in_bf16_and_follows_torch(stage):
    kind = "lora"
    reference = make(kind)
    frozen = frozen_of(reference)
    want_losses, reference = bf16_reference(reference, batches(kind))

    model = make(kind)
    engine = open_engine(model, stage, bf16=True)
    losses, _ = train_zinf(engine, batches(kind))
    # Within bf16's rounding of the weights (measured: losses 3e-4, masters 4e-3 apart).
    assert losses == pytest.approx(want_losses, rel=1e-3)
    gathered = gathered_frozen(model, frozen) if stage == 3 else dict(model.named_parameters())
    for name, param in model.named_parameters():
        assert param.dtype == torch.bfloat16, name
        if name in frozen:
            # Rounded once at initialize() and never changed.
            assert gathered[name].dtype == torch.bfloat16, name
            assert torch.equal(gathered[name], frozen[name].to(torch.bfloat16)), name
    for name, expected in reference.named_parameters():
        if name not in frozen:
            got = engine.read_parameter(name)
            error = ((got - expected.float()).norm() / expected.float().norm()).item()
            assert error < 1e-2, f"{name}: relative error {error:.2e}"


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("stage", [1, 2])
def test_checkpoint_keeps_frozen_weights_and_resumes_bit_identically(stage, bf16, tmp_path):
    kind = "lora"
    data = batches(kind, 2 * STEPS)
    engine = open_engine(make(kind), stage, bf16)
    train_zinf(engine, data[:STEPS])
    engine.save_checkpoint(str(tmp_path))
    expected, _ = train_zinf(engine, data[STEPS:])
    expected_state = {k: v.clone() for k, v in engine.module.state_dict().items()}

    # Another seed: every weight, frozen ones included, differs until the load.
    model = make(kind, seed=99)
    resumed = open_engine(model, stage, bf16)
    assert not torch.equal(model.first.base.weight, expected_state["first.base.weight"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.load_checkpoint(str(tmp_path))
    losses, _ = train_zinf(resumed, data[STEPS:])
    assert losses == expected
    state = resumed.module.state_dict()
    assert list(state) == list(expected_state)
    for name, values in expected_state.items():
        assert state[name].dtype == values.dtype and torch.equal(state[name], values), name
    for name in trainable_names(model):
        assert torch.equal(resumed.read_parameter(name), engine.read_parameter(name)), name


def check_16bit_saves(engine, tmp_path, frozen, names):
    """save_16bit_model writes `names` in bf16, the frozen weights as registered and rounded, and
    with exclude_frozen_parameters=True the same without the frozen ones."""
    engine.save_16bit_model(str(tmp_path / "full"))
    engine.save_16bit_model(str(tmp_path / "adapters"), exclude_frozen_parameters=True)
    full = torch.load(tmp_path / "full" / "pytorch_model.bin")
    adapters = torch.load(tmp_path / "adapters" / "pytorch_model.bin")
    assert list(full) == names
    assert sorted(adapters) == sorted(set(full) - set(frozen))
    for name in frozen:
        assert full[name].dtype == torch.bfloat16
        assert torch.equal(full[name], frozen[name].to(torch.bfloat16)), name
    for name in adapters:
        assert torch.equal(adapters[name], full[name]), name


def test_exclude_frozen_parameters_leaves_them_out_of_saves(tmp_path):
    kind = "lora"
    model = make(kind)
    frozen = frozen_of(model)
    engine = open_engine(model, 2, bf16=True)
    train_zinf(engine, batches(kind, 2))

    # save_16bit_model: the module's state_dict in bf16, the frozen weights among them, or not.
    check_16bit_saves(engine, tmp_path, frozen, list(model.state_dict()))

    # zero_to_fp32's functions give the frozen weights of a checkpoint that holds them.
    engine.save_checkpoint(str(tmp_path / "with"))
    engine.save_checkpoint(str(tmp_path / "without"), exclude_frozen_parameters=True)
    weights = zinf.torch.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "with"))
    assert sorted(weights) == sorted(n for n, _ in model.named_parameters())
    for name in frozen:
        assert weights[name].dtype == torch.float32
        assert torch.equal(weights[name], frozen[name].to(torch.bfloat16).float()), name
    for name in trainable_names(model):
        assert torch.equal(weights[name], engine.read_parameter(name)), name
    weights = zinf.torch.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "without"))
    assert sorted(weights) == sorted(trainable_names(model))
    plain = zinf.torch.load_state_dict_from_zero_checkpoint(make(kind, seed=5),
                                                            str(tmp_path / "with"))
    for name, param in plain.named_parameters():
        assert torch.equal(param, weights[name] if name in weights else
                           frozen[name].to(torch.bfloat16).float()), name

    # A checkpoint saved without them loads without a warning; the model keeps its own.
    other = make(kind, seed=99)
    kept = frozen_of(other)
    resumed = open_engine(other, 2, bf16=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.load_checkpoint(str(tmp_path / "without"))
    for name, param in other.named_parameters():
        if name in kept:
            assert torch.equal(param, kept[name].to(torch.bfloat16)), name
        else:
            assert torch.equal(resumed.read_parameter(name), engine.read_parameter(name)), name


def test_a_checkpoint_whose_frozen_parameters_differ_warns_naming_them(tmp_path):
    engine = open_engine(make("lora"), 2)
    engine.save_checkpoint(str(tmp_path))
    # The same trainable parameters, one frozen parameter fewer.
    model = make("lora")
    del model.second.base.bias
    model.second.base.register_buffer("bias", torch.zeros(16), persistent=False)
    resumed = open_engine(model, 2)
    with pytest.warns(UserWarning, match=r"frozen parameters \['second.base.bias'\] are not the "
                                         r"model's frozen parameters"):
        resumed.load_checkpoint(str(tmp_path))


def decay_groups(model, trainable_only):
    decay = [p for n, p in model.named_parameters()
             if not n.endswith("bias") and (p.requires_grad or not trainable_only)]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def test_frozen_parameters_given_in_groups_are_dropped_from_them():
    # The common call: every parameter in model_parameters, frozen ones included, two groups;
    # torch's AdamW over the same groups less the frozen embedding is the reference.
    kind = "embedding"
    reference = make(kind)
    want, _ = train_torch(reference, batches(kind), decay_groups(reference, True))
    model = make(kind)
    groups = decay_groups(model, False)
    engine = open_engine(model, 2, model_parameters=groups)
    assert [len(g["params"]) for g in engine.optimizer.param_groups] == [
        len(groups[0]["params"]) - 1, len(groups[1]["params"])]
    assert all(p.requires_grad for g in engine.optimizer.param_groups for p in g["params"])
    losses, _ = train_zinf(engine, batches(kind))
    assert losses == pytest.approx(want, rel=1e-5)

    # Left out of model_parameters they are not trained either, the same run as with them
    # given; a parameter that requires grad must not be left out.
    model = make(kind)
    given, _ = train_zinf(open_engine(model, 1), batches(kind))
    model = make(kind)
    engine = open_engine(model, 1, model_parameters=[p for p in model.parameters()
                                                     if p.requires_grad])
    assert train_zinf(engine, batches(kind))[0] == given
    model = make(kind)
    with pytest.raises(NotImplementedError, match=r"leaves out 1 of the model's parameters "
                                                  r"\(\['head.0.bias'\]\) that require grad"):
        open_engine(model, 1, model_parameters=[p for n, p in model.named_parameters()
                                                if n != "head.0.bias"])


def test_frozen_parameters_read_through_gathered_parameters_and_external_registration():
    model = make("lora")
    frozen = frozen_of(model)
    engine = open_engine(model, 2)
    zinf.torch.register_external_parameter(model.head, model.first.base.weight)
    with zinf.torch.GatheredParameters(list(model.parameters())):
        assert torch.equal(model.first.base.weight, frozen["first.base.weight"])
    train_zinf(engine, batches("lora", 1))
    assert torch.equal(model.first.base.weight, frozen["first.base.weight"])


def test_a_model_with_nothing_to_train_is_refused():
    model = make("lora")
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="none of the model's 10 parameters requires grad"):
        open_engine(model, 2)


@pytest.mark.parametrize("kind", ["lora", "mixed"])
def test_stage_3_checkpoint_keeps_frozen_weights_and_resumes_bit_identically(kind, tmp_path):
    data = batches(kind, 2 * STEPS)
    engine = open_engine(make(kind), 3)
    train_zinf(engine, data[:STEPS])
    engine.save_checkpoint(str(tmp_path))
    expected, _ = train_zinf(engine, data[STEPS:])
    expected_state = engine._zero3_consolidated_16bit_state_dict()

    # Another seed: every weight, frozen ones included, differs until the load.
    model = make(kind, seed=99)
    frozen = frozen_of(model)
    resumed = open_engine(model, 3)
    name = next(iter(frozen))
    assert not torch.equal(resumed.read_parameter(name), expected_state[name])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.load_checkpoint(str(tmp_path))
    losses, _ = train_zinf(resumed, data[STEPS:])
    assert losses == expected
    state = resumed._zero3_consolidated_16bit_state_dict()
    assert list(state) == list(expected_state)
    for name, values in expected_state.items():
        assert state[name].dtype == values.dtype and torch.equal(state[name], values), name


@pytest.mark.parametrize("exclude_frozen", [False, True])
def test_stage_3_consolidated_state_dict_is_freed_with_its_last_reference(exclude_frozen):
    # The full copy of the model goes when the caller drops it, not at the garbage collector's
    # next pass (off here, so that a reference cycle holding it is seen every time).
    engine = open_engine(make("lora"), 3)
    collecting = gc.isenabled()
    gc.disable()
    try:
        state = engine._zero3_consolidated_16bit_state_dict(
            exclude_frozen_parameters=exclude_frozen)
        assert len(state) == (6 if exclude_frozen else 10)
        kept = [weakref.ref(values) for values in state.values()]
        del state
        assert [ref() for ref in kept] == [None] * len(kept)
    finally:
        if collecting:
            gc.enable()


def test_stage_3_saves_and_exports_frozen_weights_unless_excluded(tmp_path):
    kind = "lora"
    model = make(kind)
    frozen = frozen_of(model)
    engine = open_engine(model, 3, bf16=True)
    train_zinf(engine, batches(kind, 2))

    check_16bit_saves(engine, tmp_path, frozen, [n for n, _ in model.named_parameters()])

    # The frozen weights are engine parameters: the checkpoint's fp32 masters hold them, as
    # registered (not rounded to bf16).
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    weights = zinf.torch.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"))
    assert sorted(weights) == sorted(n for n, _ in model.named_parameters())
    for name in frozen:
        assert torch.equal(weights[name], frozen[name]), name
    for name in trainable_names(model):
        assert torch.equal(weights[name], engine.read_parameter(name)), name


def test_stage_3_frozen_parameters_are_written_through_gathered_parameters():
    model = make("lora")
    frozen = frozen_of(model)
    engine = open_engine(model, 3)
    weight = model.first.base.weight
    new = torch.randn(16, 6, generator=torch.Generator().manual_seed(8))
    with zinf.torch.GatheredParameters([weight], modifier_rank=0):
        assert torch.equal(weight, frozen["first.base.weight"])
        weight.data.copy_(new)
    assert torch.equal(engine.read_parameter("first.base.weight"), new)
    train_zinf(engine, batches("lora", 2))
    assert torch.equal(engine.read_parameter("first.base.weight"), new)


def test_a_refused_engine_closes_quietly_at_exit():
    # The refused engine is still open at exit, without the state initialize() would have made:
    # closing it must not raise (it did, with "Exception ignored in atexit callback").
    code = textwrap.dedent("""
        import torch, zinf.torch
        from conftest import zinf_config
        model = torch.nn.Linear(3, 3)
        model.requires_grad_(False)
        try:
            zinf.torch.initialize(model=model, config=zinf_config(3))
        except ValueError as error:
            kept = error  # holds the engine through the traceback until exit
        print("refused")
        """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=os.path.dirname(__file__), timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "refused", done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("stage", [2, 3])
def test_a_peft_lora_gpt2_trains_as_torch(stage, tmp_path):
    # peft's LoRA on a tiny GPT-2 (built from a config): the base model frozen, adapters on
    # c_attn and c_proj; the same run in plain torch (AdamW over the adapters, clipped) is the
    # reference, and peft's save_pretrained writes the trained adapters.
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")

    def build():
        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=2,
                                         n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"],
                               lora_dropout=0.0, fan_in_fan_out=True,
                               init_lora_weights="gaussian")
        return peft.get_peft_model(transformers.GPT2LMHeadModel(config), lora)

    generator = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 256, (4, 16), generator=generator) for _ in range(4)]
    reference = build()
    frozen = frozen_of(reference)
    trainable = [p for p in reference.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR, betas=BETAS, eps=EPS,
                                  weight_decay=WEIGHT_DECAY)
    want = []
    for ids in data:
        loss = reference(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, CLIP)
        optimizer.step()
        optimizer.zero_grad()
        want.append(loss.item())

    model = build()
    engine = open_engine(model, stage)
    got = []
    for ids in data:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        got.append(loss.item())
    assert got == pytest.approx(want, rel=1e-5)
    gathered = gathered_frozen(model, frozen) if stage == 3 else dict(model.named_parameters())
    for name in frozen:
        assert torch.equal(gathered[name], frozen[name]), name
    if stage == 3:
        return  # save_pretrained reads the module's (placeholder) tensors
    model.save_pretrained(str(tmp_path))
    adapters = pytest.importorskip("safetensors.torch").load_file(
        str(tmp_path / "adapter_model.safetensors"))
    assert adapters and all("lora_" in name for name in adapters)
    for name, expected in reference.named_parameters():
        if name not in frozen:
            got = engine.read_parameter(name)
            error = ((got - expected.detach()).norm() / expected.detach().norm()).item()
            assert error < 1e-5, f"{name}: relative error {error:.2e}"
            saved = adapters[name.replace(".default", "")]
            assert torch.equal(saved, got), name


class Checkpointed(nn.Module):
    """`inner` under torch.utils.checkpoint (use_reentrant as given), or as it is (None)."""

    def __init__(self, inner, reentrant):
        super().__init__()
        self.inner = inner
        self.reentrant = reentrant

    def forward(self, x):
        if self.reentrant is None:
            return self.inner(x)
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant,stray_forward", [(None, False), (None, True), (True, False),
                                                     (False, False)])
def test_stage_3_backward_gives_back_frozen_modules_as_it_goes(reentrant, stray_forward):
    # A stack of LoRA layers whose base weights are frozen: each base Linear's backward gather is
    # given back once autograd has the gradient of its input, so the backward holds a few
    # engine modules at a time, not the whole stack until its end: also with activation
    # checkpointing (a recomputation in the backward is not waited for), and after a forward
    # whose graph was dropped without a backward (not waited for either).
    torch.manual_seed(4)
    layers = 8
    model = nn.Sequential(*[Checkpointed(LoraLinear(16, 16), reentrant) for _ in range(layers)],
                          nn.Linear(16, 3))
    engine = open_engine(model, 3)
    live, peak = set(), [0]
    acquire, release = engine._acquire, engine._release

    def counting_acquire(engine_module):
        acquire(engine_module)
        live.add(engine_module)
        if engine._in_backward:
            peak[0] = max(peak[0], len(live))

    def counting_release(engine_module):
        release(engine_module)
        if engine._gather_count[engine_module] == 0:
            live.discard(engine_module)

    engine._acquire, engine._release = counting_acquire, counting_release
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(5)).requires_grad_(True)
    y = torch.randn(4, 3, generator=torch.Generator().manual_seed(6))
    # With the garbage collector off, a graph dropped without a backward is freed when its last
    # reference goes or not at all: a reference cycle that held it (and the gathers its
    # backward would wait for) until a collection fails here every time, not only when no
    # collection happened to run in between.
    collecting = gc.isenabled()
    gc.disable()
    try:
        if stray_forward:
            engine(x)  # grad enabled, its graph dropped: no backward
        for _ in range(2):
            loss = (engine(x) - y).pow(2).mean()
            engine.backward(loss)
            engine.step()
    finally:
        if collecting:
            gc.enable()
    # Measured: 1 without checkpointing, 2 with; 8 or 9 (every base Linear) when the gathers
    # are given back only at the end of the backward (non-reentrant checkpointing, or the stray
    # forward, before they were handled or while a reference cycle kept its graph).
    assert 0 < peak[0] <= 3, peak[0]
    assert not live


def test_stage_3_frozen_parameters_built_under_init_train_as_torch():
    # Built under Init, the frozen weights are staged and registered (through the engine's
    # initializers) like the trainable ones: the constructors' values, kept to the bit.
    kind = "lora"
    reference = make(kind)
    frozen = frozen_of(reference)
    want, _ = train_torch(reference, batches(kind))
    torch.manual_seed(21)
    with zinf.torch.Init(config=config(3)):
        model = Lora()  # its constructors freeze the base Linears
    assert all(p.numel() == 0 for p in model.parameters())
    engine = open_engine(model, 3)
    losses, _ = train_zinf(engine, batches(kind))
    assert losses == pytest.approx(want, rel=1e-5)
    gathered = gathered_frozen(model, frozen)
    for name in frozen:
        assert torch.equal(gathered[name], frozen[name]), name
        assert torch.equal(engine.read_parameter(name), frozen[name]), name


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_parameter_unfrozen_after_initialize_is_refused_naming_it(stage):
    # Frozen at initialize(), it has no gradient reduction and no optimizer step: unfrozen later,
    # its gradient would only grow on every rank and it would never train. The backward says so.
    torch.manual_seed(7)
    model = nn.Sequential(LoraLinear(8, 8), nn.Linear(8, 2))
    engine = open_engine(model, stage)
    try:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(8))
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        model[0].base.weight.requires_grad_(True)
        with pytest.raises(RuntimeError, match=r"parameter '0\.base\.weight' was frozen at "
                                               r"initialize\(\) and requires grad now"):
            engine.backward(engine(x).pow(2).mean())
    finally:
        engine.destroy()


@pytest.mark.parametrize("stage", [2, 3])
def test_a_parameter_frozen_after_initialize_is_warned_of_naming_it(stage):
    # Trainable at initialize(), the engine keeps stepping it: frozen later, weight decay and its
    # moments still move it. The first backward after says so, once.
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    engine = open_engine(model, stage)
    try:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(8))
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        model[0].weight.requires_grad_(False)
        with pytest.warns(UserWarning, match=r"parameter '0\.weight' required grad at "
                                             r"initialize\(\) and does not now: zinf still "
                                             r"steps it"):
            engine.backward(engine(x).pow(2).mean())
        engine.step()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            engine.backward(engine(x).pow(2).mean())  # once
    finally:
        engine.destroy()


def test_stage_2_a_checkpoint_saved_with_other_parameters_frozen_says_why(tmp_path):
    # At stages 1 and 2 frozen parameters are not engine parameters, so a checkpoint saved with
    # the base frozen does not load into an engine where it trains: the error says why.
    torch.manual_seed(7)
    model = nn.Sequential(LoraLinear(8, 8), nn.Linear(8, 2))
    engine = open_engine(model, 2)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(8))
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    engine.save_checkpoint(str(tmp_path))
    engine.destroy()
    model = nn.Sequential(LoraLinear(8, 8), nn.Linear(8, 2))
    model[0].base.requires_grad_(True)
    engine = open_engine(model, 2)
    try:
        with pytest.raises(zinf.torch.Error, match=r"'0\.base\.weight' is not in the checkpoint .*"
                                                   r"registers only the parameters that require "
                                                   r"grad"):
            engine.load_checkpoint(str(tmp_path))
    finally:
        engine.destroy()


# Two ranks (frozen_ranks.py under mpirun and under torchrun), each drawing the frozen base
# weights of test_frozen's LoRA model with a seed of its own.
RANK_STAGES = [1, 2]


def launch_two_ranks(launcher, out, args):
    if launcher == "mpirun":
        if why_mpirun_unavailable() is not None:
            pytest.skip(why_mpirun_unavailable())
        return mpirun("frozen_ranks.py", [out, *args], timeout=600)
    if why_torchrun_unavailable() is not None:
        pytest.skip(why_torchrun_unavailable())
    return torchrun("frozen_ranks.py", [out, *args], timeout=600)


@pytest.fixture(scope="module")
def mpirun_runs(tmp_path_factory):
    """One mpirun job: frozen_ranks.py's layout mode, its RANK_STAGES, then its buckets mode."""
    out = tmp_path_factory.mktemp("frozen_mpirun")
    result = launch_two_ranks("mpirun", out,
                              ["layout", *[str(stage) for stage in RANK_STAGES], "buckets"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


@pytest.fixture(scope="module", params=["mpirun", "torchrun"])
def two_rank_runs(request, tmp_path_factory):
    if request.param == "mpirun":
        return request.getfixturevalue("mpirun_runs")
    out = tmp_path_factory.mktemp(f"frozen_{request.param}")
    result = launch_two_ranks(request.param, out, [str(stage) for stage in RANK_STAGES])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def rank_reports(out, stage):
    reports = [torch.load(out / f"{stage}.rank{rank}.pt") for rank in (0, 1)]
    assert [r["world_size"] for r in reports] == [2, 2]
    return reports


@pytest.mark.parametrize("stage", RANK_STAGES)
def test_ranks_that_drew_other_frozen_weights_train_rank_0s_model(stage, two_rank_runs):
    # DeepSpeed's engine broadcasts the module's parameters from rank 0 at initialize: after
    # initialize() every rank holds rank 0's frozen weights, and the two ranks, each on half of
    # every batch, train what plain torch trains on the full batch with rank 0's model.
    from frozen_ranks import make_with_frozen_seed

    ranks = rank_reports(two_rank_runs, stage)
    for name, built in ranks[0]["built"].items():
        assert not torch.equal(ranks[1]["built"][name], built), name  # drawn differently
        for rank, report in enumerate(ranks):
            assert torch.equal(report["initialized"][name], built), f"rank {rank}: {name}"
    reference = make_with_frozen_seed(21, 100)
    want, _ = train_torch(reference, batches("lora"))
    # Each rank's loss is the mean over its half of the batch: their mean is the full batch's.
    got = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"])]
    assert got == pytest.approx(want, rel=1e-5)
    for name in trainable_names(reference):
        expected = dict(reference.named_parameters())[name].detach()
        error = ((ranks[0]["masters"][name] - expected).norm() / expected.norm()).item()
        assert error < 1e-5, f"{name}: relative error {error:.2e}"
        assert torch.equal(ranks[1]["masters"][name], ranks[0]["masters"][name]), name


@pytest.mark.parametrize("stage", RANK_STAGES)
def test_a_checkpoint_loads_its_frozen_weights_on_every_rank(stage, two_rank_runs):
    # Resumed into a model whose frozen weights each rank drew again (rank 0's of those on every
    # rank after initialize()), load_checkpoint gives every rank the checkpoint's (rank 0's at
    # the save), and the run goes on bit for bit.
    from frozen_ranks import CHECKPOINT_STEP

    ranks = rank_reports(two_rank_runs, stage)
    saved = ranks[0]["initialized"]
    for name, values in saved.items():
        for rank, report in enumerate(ranks):
            assert torch.equal(report["resumed_initialized"][name],
                               ranks[0]["resumed_initialized"][name]), f"rank {rank}: {name}"
            assert not torch.equal(report["resumed_initialized"][name], values), name
            assert torch.equal(report["loaded"][name], values), f"rank {rank}: {name}"
    for rank, report in enumerate(ranks):
        assert report["resumed_losses"] == report["losses"][CHECKPOINT_STEP:], f"rank {rank}"


def test_ranks_whose_frozen_parameters_differ_in_shape_are_refused_on_every_rank(mpirun_runs):
    # Rank 1 has one frozen parameter fewer (the trainable ones are the same, so the engine's
    # finalize does not see it): every rank raises the same error, none waits for the others
    # (the job's stages then run on).
    for rank in (0, 1):
        with open(mpirun_runs / f"layout.rank{rank}.json") as f:
            error = json.load(f)["error"]
        assert error is not None and ("the frozen parameters (requires_grad False) of rank 1 "
                                      "differ from rank 0's in their names, shapes or dtypes"
                                      in error), error


def test_frozen_parameters_move_in_buckets_of_rank_0s_bytes(mpirun_runs):
    # initialize() broadcasts consecutive frozen parameters together, up to a bucket's bytes
    # (frozen_ranks.BUCKET_BYTES here), one larger than a bucket alone: every rank ends with rank
    # 0's values, a parameter over a non-contiguous layout included.
    reports = [torch.load(mpirun_runs / f"buckets.rank{rank}.pt") for rank in (0, 1)]
    for rank, report in enumerate(reports):
        assert report["carried"] == [["first.base.weight", "first.base.bias"],
                                     ["second.base.weight"], ["second.base.bias"]], rank
        assert not report["contiguous"]
        for name, values in reports[0]["built"].items():
            assert torch.equal(report["initialized"][name], values), f"rank {rank}: {name}"
            if rank == 1:
                assert not torch.equal(report["built"][name], values), name
