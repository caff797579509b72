"""zinf._zinf, the binding: parameters cross as DLPack arrays over the engine's memory, dtypes
map both ways, and errors carry the engine's code and the name involved."""
import json

import pytest
import torch

import zinf
from _helpers import mpirun, torchrun, why_mpirun_unavailable, why_torchrun_unavailable


def open_engine(stage=1, dtype="f32", values=None, **zero):
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 0.1, "weight_decay": 0.0}},
              "zero_optimization": {"stage": stage, **zero}, "zinf": {"cpu_threads": 1}}
    engine = zinf.Engine(json.dumps(config))
    generator = torch.Generator().manual_seed(5)
    values = torch.randn(3, 4, generator=generator) if values is None else values
    engine.register_parameter("w", "layer", [3, 4], dtype, values)
    engine.finalize()
    return engine, values


def test_parameter_is_the_engines_memory_without_a_copy():
    engine, values = open_engine()
    engine.gather("layer")  # bookkeeping at stage 1: the device copy is always there
    first = torch.from_dlpack(engine.parameter("w"))
    second = torch.from_dlpack(engine.parameter("w"))
    assert first.shape == (3, 4) and first.dtype == torch.float32
    assert torch.equal(first, values)
    # Two views of the same engine memory: a write through one shows in the other.
    assert first.data_ptr() == second.data_ptr()
    first[1, 2] = 42.0
    assert second[1, 2].item() == 42.0


@pytest.mark.parametrize("dtype,torch_dtype", [("bf16", torch.bfloat16), ("f16", torch.float16)])
def test_half_parameters_round_the_initial_values(dtype, torch_dtype):
    engine, values = open_engine(dtype=dtype)
    engine.gather("layer")
    tensor = torch.from_dlpack(engine.parameter("w"))
    assert tensor.dtype == torch_dtype
    assert torch.equal(tensor, values.to(torch_dtype))


def test_step_applies_adamw_to_the_reduced_gradient():
    engine, values = open_engine()
    grad = torch.randn(3, 4, generator=torch.Generator().manual_seed(6))
    engine.reduce_gradients("layer", ["w"], [grad])
    report = engine.step()
    assert report["step"] == 1 and not report["skipped"]
    # AdamW's first step with weight decay 0: p - lr * g / (|g| + eps) = p - lr * sign(g).
    expected = values - 0.1 * grad / (grad.abs() + 1e-8)
    out = torch.empty(3, 4)
    engine.read_parameters("w", out)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-7)
    engine.gather("layer")
    torch.testing.assert_close(torch.from_dlpack(engine.parameter("w")), expected, rtol=1e-6,
                               atol=1e-7)


def test_stage3_parameter_exists_only_while_gathered():
    engine, values = open_engine(stage=3, stage3_param_persistence_threshold=0)
    with pytest.raises(zinf.Error, match="failed_precondition.*w"):
        engine.parameter("w")
    engine.gather("layer")
    assert torch.equal(torch.from_dlpack(engine.parameter("w")), values)
    assert engine.counters()["live_elements"] >= 12  # padded to the gather alignment
    engine.release("layer")
    assert engine.counters()["live_elements"] == 0


def test_errors_name_what_was_wrong():
    engine, _ = open_engine()
    with pytest.raises(zinf.Error, match="not_found.*nowhere"):
        engine.gather("nowhere")
    with pytest.raises(zinf.Error, match="invalid_argument.*w"):
        engine.reduce_gradients("layer", ["w"], [torch.zeros(5)])
    with pytest.raises(zinf.Error, match="zero_optimization.stage"):
        zinf.Engine(json.dumps({"zero_optimization": {"stage": 4}}))
    with pytest.raises(zinf.Error, match="invalid_argument"):
        engine.set_learning_rate(float("nan"))
    with pytest.raises(zinf.Error, match="read_parameters.*2 floats"):
        engine.read_parameters("w", torch.empty(2))


def open_two_parameter_engine(stage):
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 0.1, "weight_decay": 0.0}},
              "zero_optimization": {"stage": stage, "sub_group_size": 16},
              "zinf": {"cpu_threads": 1}}
    engine = zinf.Engine(json.dumps(config))
    generator = torch.Generator().manual_seed(7)
    initial = {"a.w": torch.randn(5, 7, generator=generator),
               "b.w": torch.randn(3, generator=generator)}
    engine.register_parameter("a.w", "a", [5, 7], "f32", initial["a.w"])
    engine.register_parameter("b.w", "b", [3], "f32", initial["b.w"])
    engine.finalize()
    return engine, initial


@pytest.mark.parametrize("stage", [1, 3])
def test_write_parameters_batch_takes_each_parameter_from_values_fn(stage):
    engine, initial = open_two_parameter_engine(stage)
    generator = torch.Generator().manual_seed(8)
    fresh = {"a.w": torch.randn(5, 7, generator=generator),
             "b.w": torch.randn(3, generator=generator)}
    asked = []

    def values_fn(name):
        asked.append(name)
        return fresh[name]

    engine.write_parameters_batch(["b.w", "a.w"], values_fn, 0)
    assert sorted(asked) == ["a.w", "b.w"]
    for name, values in fresh.items():
        out = torch.empty(values.shape)
        engine.read_parameters(name, out)
        assert torch.equal(out, values)
    engine.gather("a")
    assert torch.equal(torch.from_dlpack(engine.parameter("a.w")), fresh["a.w"])
    engine.release("a")
    # Refused before anything is written: the masters stay and the engine goes on.
    with pytest.raises(zinf.Error, match="not_found: write_parameters\\('c.w'\\)"):
        engine.write_parameters_batch(["a.w", "c.w"], values_fn, 0)
    with pytest.raises(zinf.Error, match="invalid_argument: write_parameters\\('a.w'\\).*twice"):
        engine.write_parameters_batch(["a.w", "a.w"], values_fn, 0)
    with pytest.raises(zinf.Error, match="invalid_argument.*values is null on the root"):
        engine.write_parameters_batch(["a.w"], None, 0)
    out = torch.empty(5, 7)
    engine.read_parameters("a.w", out)
    assert torch.equal(out, fresh["a.w"])


@pytest.mark.parametrize("returned,match", [
    (lambda name: torch.zeros(4), "values_fn returned 4 values for a parameter of 3"),
    (lambda name: 1 / 0, "values_fn raised ZeroDivisionError: division by zero"),
    (lambda name: "text", "values_fn returned str, not a contiguous float32 CPU array"),
])
def test_write_parameters_batch_fails_for_bad_values(returned, match):
    engine, _ = open_two_parameter_engine(1)
    with pytest.raises(zinf.Error) as raised:
        engine.write_parameters_batch(["b.w"], returned, 0)
    assert str(raised.value) == f"invalid_argument: write_parameters('b.w'): values: {match}"


def test_client_collectives_in_one_rank_and_their_refusals():
    """broadcast_bytes and all_gather_bytes over a one-rank engine: the bytes stay (the root's
    own, of any size), the gather is the send, of any size; a wrong recv size, a send that
    overlaps recv and a root outside the world are refused naming the call. (Several ranks:
    test_client_collectives_on_two_ranks_give_every_rank_the_bytes_sent.)"""
    engine, _ = open_engine()
    generator = torch.Generator().manual_seed(11)
    values = torch.randn(6, generator=generator).to(torch.bfloat16)
    expected = values.clone()
    engine.broadcast_bytes(values.view(torch.uint8), 0, "values")
    assert torch.equal(values, expected)
    odd = torch.randint(0, 256, (3,), dtype=torch.uint8, generator=generator)
    expected = odd.clone()
    engine.broadcast_bytes(odd, 0, "odd")
    assert torch.equal(odd, expected)
    send = torch.randint(0, 256, (16,), dtype=torch.uint8, generator=generator)
    recv = torch.full((1, 16), 0xA5, dtype=torch.uint8)
    engine.all_gather_bytes(send, recv, "digest")
    assert torch.equal(recv[0], send)
    recv = torch.full((1, 3), 0xA5, dtype=torch.uint8)
    engine.all_gather_bytes(odd, recv, "odd")
    assert torch.equal(recv[0], odd)
    with pytest.raises(zinf.Error, match=r"all_gather_bytes\('short'\).*recv 8 \(must be 16\)"):
        engine.all_gather_bytes(send, torch.empty(8, dtype=torch.uint8), "short")
    # send inside recv (in place) or overlapping it is refused: with an odd size the packed
    # prefixes would overwrite the send before it is read. Neighbouring ranges are not.
    memory = torch.randint(0, 256, (8,), dtype=torch.uint8, generator=generator)
    before = memory.clone()
    for send_at, recv_at in ((0, 0), (2, 0), (0, 2)):
        with pytest.raises(zinf.Error, match=r"invalid_argument: all_gather_bytes\('overlap'\): "
                           r"send and recv overlap \(send holds 3 bytes, recv 3\)"):
            engine.all_gather_bytes(memory[send_at:send_at + 3],
                                    memory[recv_at:recv_at + 3].view(1, 3), "overlap")
        assert torch.equal(memory, before)
    engine.all_gather_bytes(memory[3:6], memory[0:3].view(1, 3), "neighbours")
    assert torch.equal(memory[0:3], before[3:6])
    with pytest.raises(zinf.Error, match="root"):
        engine.broadcast_bytes(values.view(torch.uint8), 1, "values")
    engine.close()
    with pytest.raises(zinf.Error, match="closed"):
        engine.broadcast_bytes(values.view(torch.uint8), 0, "values")


@pytest.mark.parametrize("launcher", ["mpirun", "torchrun"])
def test_client_collectives_on_two_ranks_give_every_rank_the_bytes_sent(launcher, tmp_path):
    """bytes_ranks.py on two ranks, over the "mpi" and the "torch" communicator: after each
    broadcast every rank holds the root's bytes, and after each all-gather every rank's bytes
    rank after rank, whatever the size, odd ones included (each rank's own bytes differ from the
    other's: a collective that moved nothing would fail)."""
    from bytes_ranks import SIZES, drawn

    if launcher == "mpirun":
        if why_mpirun_unavailable() is not None:
            pytest.skip(why_mpirun_unavailable())
        result = mpirun("bytes_ranks.py", [tmp_path, "mpi"], timeout=120)
    else:
        if why_torchrun_unavailable() is not None:
            pytest.skip(why_torchrun_unavailable())
        result = torchrun("bytes_ranks.py", [tmp_path, "torch"], timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for rank in (0, 1):
        report = torch.load(tmp_path / f"bytes.rank{rank}.pt")
        assert report["world_size"] == 2
        for size in SIZES:
            for root in (0, 1):
                assert torch.equal(report["received"][(size, root)], drawn(size, root)), \
                    (rank, size, root)
                if root != rank:
                    assert not torch.equal(drawn(size, rank), drawn(size, root)), (size, rank)
            assert torch.equal(report["gathered"][size],
                               torch.stack([drawn(size, 0), drawn(size, 1)])), (rank, size)
