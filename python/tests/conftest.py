"""Shared helpers of the zinf package's tests: the example's model and data, and plain torch's
run of them (the oracle)."""
import os
import sys

import pytest
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "examples", "torch_gpt"))

import gpt  # noqa: E402

# The oracle's problem: the example's GPT-2 (2 blocks of 64, tied embeddings, 120,576
# parameters), 20 steps of AdamW on batches of 4 x 32 bytes, the global norm clipped to 1.
STEPS = 20
BATCH, SEQUENCE = 4, 32
LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 3e-3, (0.9, 0.999), 1e-8, 0.01, 1.0

torch.set_num_threads(1)


def make_model():
    return gpt.make_model(seed=1, layers=2, width=64, heads=4, context=SEQUENCE)


def make_batches(steps=STEPS, seed=2):
    data = gpt.batches(gpt.read_text(), BATCH, SEQUENCE, seed=seed)
    return [next(data) for _ in range(steps)]


def zinf_config(stage, offload="none", offload_param="none", nvme_path=None, bf16=False, **zero):
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_clipping": CLIP,
        "bf16": {"enabled": bf16},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                  "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": {"stage": stage,
                              "offload_optimizer": {"device": offload},
                              "offload_param": {"device": offload_param}},
        "zinf": {"cpu_threads": 1},
    }
    if nvme_path is not None:
        config["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(nvme_path)
        config["zero_optimization"]["offload_param"]["nvme_path"] = str(nvme_path)
    config["zero_optimization"].update(zero)
    return config


def train_zinf(engine, batches):
    losses = []
    for ids, labels in batches:
        loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def train_torch(model, optimizer, batches, scheduler=None, set_lrs=None):
    """Plain torch's training loop, the oracle of the zinf runs: for step k = 1, 2, ...
    set_lrs(k, optimizer) when given, the loss, backward, clip_grad_norm_ to CLIP, the optimizer's
    step, the scheduler's step when given, zero_grad. Returns the per-step losses."""
    losses = []
    for k, (ids, labels) in enumerate(batches, start=1):
        if set_lrs is not None:
            set_lrs(k, optimizer)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="session")
def torch_reference():
    """Plain torch: the same model and batches, torch.optim.AdamW, clip_grad_norm_. Returns
    (per-step losses, final parameters by name)."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                  weight_decay=WEIGHT_DECAY)
    losses = train_torch(model, optimizer, make_batches())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


# A small problem for the tests that need a model but not GPT-2: a seeded MLP with a dropout and
# a LayerNorm, regressing random targets.
def make_mlp(seed=11, dropout=0.0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(dropout),
                               torch.nn.Tanh(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3))


def mlp_batches(count, seed=12):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, generator=generator), torch.randn(4, 3, generator=generator))
            for _ in range(count)]


def mlp_loss(model, batch):
    x, y = batch
    return (model(x) - y).pow(2).mean()


def mlp_config(stage, offload="none", nvme_path=None):
    """zinf_config for the MLP: at stage 3 the parameters sharded too, on the optimizer's tier."""
    extra = {"stage3_param_persistence_threshold": 0} if stage == 3 else {}
    return zinf_config(stage, offload, offload if stage == 3 else "none", nvme_path, **extra)


def train_mlp_torch(model, batches):
    """Plain torch's loop for the MLP (AdamW, the norm clipped to CLIP): the oracle."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                  weight_decay=WEIGHT_DECAY)
    losses = []
    for batch in batches:
        loss = mlp_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def train_mlp_zinf(engine, batches, loss_of=mlp_loss):
    """zinf's training loop over `batches` (the loss loss_of(engine, batch)): the per-step
    losses."""
    losses = []
    for batch in batches:
        loss = loss_of(engine, batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def assert_mlp_matches(engine, reference, rel=1e-5):
    """Every parameter's fp32 master within rel (relative L2) of the reference model's."""
    for name, expected in reference.named_parameters():
        got = engine.read_parameter(name)
        error = ((got - expected.detach()).norm() / expected.detach().norm()).item()
        assert error < rel, f"{name}: relative error {error:.2e}"


# The parametrisation of the tests where rank 1 of 2 raises (mp_train.py's "fail" mode), and
# what rank 0's error must then say.
RANK_1_RAISES = [("backward", "rank 1 of 2 raised Boom in backward"),
                 ("loop", "rank 1 of 2 raised Boom: injected failure in the training loop")]


def assert_rank_0_failed_naming_rank_1(result, ended, said, launcher):
    """The job `result` (a CompletedProcess of mp_train.py's "fail" mode under `launcher`, which
    returned at time `ended`) failed without finishing, and rank 0's error names rank 1 and what
    it raised (`said`). Returns the seconds from rank 1's raise to the launcher's return."""
    import re

    output = result.stdout + result.stderr
    raised = re.search(r"rank 1 raises at ([0-9.]+)", output)
    assert raised, output[-3000:]
    elapsed = ended - float(raised.group(1))
    assert result.returncode != 0, output[-3000:]
    assert "finished all steps" not in output, output[-3000:]
    rank0 = [line for line in output.splitlines() if "rank 0 of 2" in line and said in line]
    assert rank0, output[-3000:]
    print(rank0[0])
    print(f"{launcher} returned {result.returncode} {elapsed:.1f} s after rank 1 raised")
    return elapsed


def relative_errors(params, reference):
    """(relative L2 error over the whole model, the worst parameter's) of `params` against
    `reference` (name -> tensor each, the same names). The key third of each c_attn.bias is left
    out of the per-parameter figure (test_oracle.key_bias: its gradient is zero up to rounding)."""
    from test_oracle import key_bias

    assert set(params) == set(reference)
    diff_sq = ref_sq = worst = 0.0
    for name, expected in reference.items():
        error = params[name] - expected
        diff_sq += (error ** 2).sum().item()
        ref_sq += (expected ** 2).sum().item()
        if key_bias(name) is not None:
            error[key_bias(name)] = 0
        worst = max(worst, (error.norm() / expected.norm()).item())
    return (diff_sq / ref_sq) ** 0.5, worst


def assert_two_ranks_match_torch(out, case, torch_reference, launcher):
    """mp_train.py's oracle `case` run on two ranks (its files in `out`) ends where plain torch
    ends on the full batch: each step's loss (the mean of the ranks' halves) and the model
    within 1e-5; at stage 3 the recorded order replayed and nothing left gathered."""
    import json

    reference_losses, reference_params = torch_reference
    ranks = []
    for rank in (0, 1):
        with open(out / f"{case}.rank{rank}.json") as f:
            ranks.append(json.load(f))
    assert [r["world_size"] for r in ranks] == [2, 2]
    # Each rank's loss is the mean over its half of the batch; both halves have as many tokens,
    # so their mean is the full batch's loss.
    for step, expected in enumerate(reference_losses):
        got = (ranks[0]["losses"][step] + ranks[1]["losses"][step]) / 2
        assert got == pytest.approx(expected, rel=1e-5), f"step {step}"
    model_error, worst = relative_errors(torch.load(out / f"{case}.pt"), reference_params)
    print(f"{case}, 2 ranks under {launcher}: relative error of the model {model_error:.2e}, of "
          f"the worst parameter {worst:.2e}")
    assert model_error < 1e-5
    assert worst < 1e-5
    if case.startswith("3-"):
        for r in ranks:
            assert r["counters"]["order_misses"] == 0
            assert r["counters"]["live_elements"] == 0
