"""Run by test_gathered_write.py under mpirun (one process per rank): GatheredParameters(
modifier_rank=0) on two ranks after initialize(), at stage 3 with bf16 (the MLP of conftest,
trained two steps first), with the collective timeout short so that a rank left waiting fails
fast. Each scenario records the fp32 masters before and after its block (a step trains between
them):

  noop:        every parameter given, nothing changed
  one:         rank 0 sets 4.bias to seeded random values; rank 1 sets 0.weight to others (only
               the modifier rank's changes count)
  order:       rank 1 lists the parameters in the reverse order; rank 0 sets 0.bias; then one
               step trains on every rank
  raise_other: rank 0 sets 3.weight; the block raises on rank 1 only
  raise_root:  rank 0 sets 3.bias, then the block raises on rank 0 only
  reshape:     rank 0 points 4.bias at a tensor of another shape (every rank raises ValueError,
               nothing is written); then one step trains on every rank

    mpirun -np 2 python gathered_ranks.py <out_dir>

Writes <out_dir>/gathered_ranks.rank<r>.pt: {scenario: {"before", "after", "set", "error"}}
(the masters by name, the values rank 0 set, and the message of what the block raised here).

Before those, in the same job, stage2_views(): at stage 2 (fp32) the views of the parameters
after blocks on two ranks (see its docstring); every rank asserts what it checks and writes the
sum of 0.weight after a last step to <out_dir>/stage2.rank<r>."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zinf.torch  # noqa: E402
from conftest import make_mlp, mlp_batches, mlp_config, mlp_loss, train_mlp_zinf  # noqa: E402


def train(engine, count, seed):
    for x, y in mlp_batches(count, seed=seed):
        engine.backward(mlp_loss(engine, (x.bfloat16(), y)).float())
        engine.step()


def stage2_views(out_dir):
    """Stage 2: after a block whose end writes rank 0's change to 0.weight (rank 1 pointing
    4.bias's .data elsewhere, which is not written), and after one where rank 0 changed nothing
    (rank 1 pointing 3.weight elsewhere), every parameter is on the memory it had and holds the
    engine's values; then one step trains."""
    model = make_mlp()
    config = mlp_config(2)
    config["zinf"]["collective_timeout_ms"] = 20000
    engine, _, _, _ = zinf.torch.initialize(model=model, config=config)
    rank = engine.global_rank
    train_mlp_zinf(engine, mlp_batches(2))
    views = {name: p.data_ptr() for name, p in model.named_parameters()}
    weight = torch.randn(16, 6, generator=torch.Generator().manual_seed(41))
    stray = torch.randn(3, generator=torch.Generator().manual_seed(42 + rank))
    # Rank 0 writes 0.weight; rank 1 points 4.bias elsewhere, which is not written.
    bias = engine.read_parameter("4.bias")
    with zinf.torch.GatheredParameters([model[0].weight, model[4].bias], modifier_rank=0):
        if rank == 0:
            model[0].weight.data.copy_(weight)
        else:
            model[4].bias.data = stray.clone()
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == views, rank
    assert torch.equal(model[0].weight.detach(), weight), rank
    assert torch.equal(engine.read_parameter("0.weight"), weight), rank
    assert torch.equal(model[4].bias.detach(), bias), rank
    # Rank 0 changes nothing; rank 1 points 3.weight elsewhere: back on the engine's copy too.
    norm = engine.read_parameter("3.weight")
    with zinf.torch.GatheredParameters([model[3].weight], modifier_rank=0):
        if rank == 1:
            model[3].weight.data = torch.zeros(16)
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == views, rank
    assert torch.equal(model[3].weight.detach(), norm), rank
    train_mlp_zinf(engine, mlp_batches(1, seed=13))
    # Each rank's outcome in a file of its own: mpirun's forwarded stdout can merge or drop the
    # ranks' last lines at exit.
    with open(os.path.join(out_dir, f"stage2.rank{rank}"), "w") as out:
        out.write(repr(float(model[0].weight.detach().sum())))
    engine.destroy()


def main():
    out_dir = sys.argv[1]
    torch.set_num_threads(1)
    stage2_views(out_dir)
    model = make_mlp()
    cfg = mlp_config(3, "cpu")
    cfg["bf16"] = {"enabled": True}
    cfg["zinf"]["collective_timeout_ms"] = 20000
    engine, _, _, _ = zinf.torch.initialize(model=model, config=cfg)
    rank = engine.global_rank
    train(engine, 2, seed=12)
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    by_name = dict(model.named_parameters())
    generator = torch.Generator().manual_seed(31 + rank)

    def masters():
        return {n: engine.read_parameter(n) for n in names}

    def draw(name):
        return torch.randn(by_name[name].ds_shape, generator=generator)

    def run(given, change=None, fail_on=None):
        """One block over `given`: change() inside it, then a RuntimeError on rank fail_on."""
        before = masters()
        values, error = None, None
        try:
            with zinf.torch.GatheredParameters(given, modifier_rank=0):
                if change is not None:
                    values = change()
                if rank == fail_on:
                    raise RuntimeError(f"the block fails on rank {rank}")
        except (RuntimeError, ValueError) as e:
            error = f"{type(e).__name__}: {e}" if isinstance(e, ValueError) else str(e)
        return {"before": before, "after": masters(), "set": values, "error": error}

    def set_to(name):
        def change():
            values = draw(name)
            by_name[name].data.copy_(values)
            return values
        return change

    # A step before each block, so that no master holds bf16 values already (as a block that
    # rewrote every master from the bf16 values would leave them).
    report = {"noop": run(params)}
    train(engine, 1, seed=13)
    report["one"] = run(params, set_to("4.bias" if rank == 0 else "0.weight"))
    train(engine, 1, seed=14)
    report["order"] = run(params if rank == 0 else params[::-1], set_to("0.bias"))
    train(engine, 1, seed=15)
    report["order"]["trained"] = masters()
    report["raise_other"] = run(params, set_to("3.weight"), fail_on=1)
    train(engine, 1, seed=16)
    report["raise_root"] = run(params, set_to("3.bias"), fail_on=0)
    train(engine, 1, seed=17)

    def reshape():
        if rank == 0:
            bias = by_name["4.bias"]
            bias.data = torch.randn(bias.ds_shape[0] + 1, generator=generator)

    report["reshape"] = run(params, reshape)
    train(engine, 1, seed=18)
    report["reshape"]["trained"] = masters()
    engine.destroy()
    torch.save(report, os.path.join(out_dir, f"gathered_ranks.rank{rank}.pt"))


if __name__ == "__main__":
    main()
