"""Run by mpirun from the multi-process tests (one process per rank): trains the oracle's GPT-2
under zinf.torch, each rank on its share of every batch, and writes what the test checks.

    mpirun -np 2 python mp_train.py oracle <out_dir> <case> [<case> ...]   (case: stage-offload)
    mpirun -np 2 python mp_train.py write <out_dir>
    mpirun -np 2 python mp_train.py init_write <out_dir> <root>
    mpirun -np 2 python mp_train.py fail <out_dir> <timeout_ms>
    mpirun -np 2 python mp_train.py loader <out_dir>
    mpirun -np 2 python mp_train.py consolidated <out_dir>
    mpirun -np 2 python mp_train.py several <out_dir> [<case> ...]

oracle: for each case, 20 steps with the config of test_oracle.py; every rank writes its
per-step losses to <out_dir>/<case>.rank<r>.json, and rank 0 the final fp32 masters (read back
through the engine, a collective) to <out_dir>/<case>.pt.
write: GatheredParameters(modifier_rank=0) with the change made on rank 0 only (see write()).
init_write: the model built under zinf.torch.Init (stage 3, every parameter sharded); rank <root>
alone loads another model's weights into it inside GatheredParameters(modifier_rank=<root>)
before initialize() (Hugging Face's ZeRO-3 from_pretrained does so on rank 0); every rank writes
the largest difference of the engine's masters from those weights to
<out_dir>/init_write.rank<r>.json. Root -1: the model built with a seed that depends on the rank
and changed nowhere; every rank writes initialize()'s error.
fail: stage 3, collective_timeout_ms <timeout_ms>; rank 1 raises from its backward (a module's
backward hook) on the second step, and rank 0 goes on as usual. Each rank's exit is the test's
to check.
loader: initialize(training_data=40 numbered samples); every rank writes the samples its loader
gave in two passes to <out_dir>/loader.rank<r>.json.
consolidated: stage 3 (bf16, parameters in host memory), one step on each rank's share, then
engine._zero3_consolidated_16bit_state_dict() on every rank: rank 0 saves it to
<out_dir>/consolidated.pt with the masters read back (<out_dir>/masters.pt); rank 1 writes
whether it got None to <out_dir>/consolidated.rank1.json.
several: in one job, one after another, oracle's cases given (into <out_dir>), then write,
init_write with root 0 and with root 1, loader and consolidated, each into a folder of <out_dir>
named after it (write, init_write0, init_write1, loader, consolidated)."""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import zinf.torch  # noqa: E402
from conftest import SEQUENCE, STEPS, gpt, make_batches, make_model, zinf_config  # noqa: E402


def shard(batch, rank, world):
    ids, labels = batch
    per = ids.shape[0] // world
    return ids[rank * per:(rank + 1) * per], labels[rank * per:(rank + 1) * per]


def oracle(out_dir, cases):
    for case in cases:
        stage, offload = case.split("-")
        stage = int(stage)
        extra = {"stage3_param_persistence_threshold": 0} if stage == 3 else {}
        nvme = os.path.join(out_dir, f"{case}.nvme")
        config = zinf_config(stage, offload, offload if stage == 3 else "none", nvme, **extra)
        model = make_model()
        engine, _, _, _ = zinf.torch.initialize(model=model, config=config,
                                                model_parameters=model.parameters())
        rank, world = engine.global_rank, engine.world_size
        losses = []
        for batch in make_batches(STEPS):
            ids, labels = shard(batch, rank, world)
            loss = engine(input_ids=ids, labels=labels).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        with open(os.path.join(out_dir, f"{case}.rank{rank}.json"), "w") as f:
            json.dump({"losses": losses, "world_size": world,
                       "counters": engine.counters()}, f)
        params = {name: engine.read_parameter(name) for name in engine._names.values()}
        if rank == 0:
            torch.save(params, os.path.join(out_dir, f"{case}.pt"))


def write(out_dir):
    """Stage 3, everything on NVMe: 2 steps, then only rank 0 changes a LayerNorm weight inside
    GatheredParameters(modifier_rank=0) (DeepSpeed's pattern); both ranks read the master back
    and train one more step."""
    config = zinf_config(3, "nvme", "nvme", os.path.join(out_dir, "nvme"),
                         stage3_param_persistence_threshold=0)
    model = make_model()
    engine, _, _, _ = zinf.torch.initialize(model=model, config=config)
    rank, world = engine.global_rank, engine.world_size
    batches = make_batches(3)
    for batch in batches[:2]:
        ids, labels = shard(batch, rank, world)
        engine.backward(engine(input_ids=ids, labels=labels).loss)
        engine.step()
    weight = model.transformer.ln_f.weight
    with zinf.torch.GatheredParameters([weight], modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                weight.copy_(torch.linspace(0.5, 1.5, weight.numel()))
    master = engine.read_parameter("transformer.ln_f.weight")
    ids, labels = shard(batches[2], rank, world)
    loss = engine(input_ids=ids, labels=labels).loss
    engine.backward(loss)
    engine.step()
    with open(os.path.join(out_dir, f"write.rank{rank}.json"), "w") as f:
        json.dump({"master": master.tolist(), "loss": loss.item()}, f)


def init_write(out_dir, root):
    config = zinf_config(3, stage3_param_persistence_threshold=0)
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    if root < 0:
        # A model built with a seed that depends on the rank, changed nowhere: initialize()
        # refuses it, naming a parameter; the error goes to the report.
        with zinf.torch.Init(config=config):
            model = gpt.make_model(seed=10 + rank, layers=2, width=64, heads=4, context=SEQUENCE)
        try:
            zinf.torch.initialize(model=model, config=config)
            error = None
        except zinf.torch.Error as e:
            error = str(e)
        with open(os.path.join(out_dir, f"init_write.rank{rank}.json"), "w") as f:
            json.dump({"error": error}, f)
        # The aborted communicator leaves MPI unfinalised, and mpirun kills every rank once one
        # exits so: each rank waits for the others' reports before it exits.
        world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
                os.path.exists(os.path.join(out_dir, f"init_write.rank{r}.json"))
                for r in range(world)):
            time.sleep(0.05)
        return
    with zinf.torch.Init(config=config):
        model = make_model()
    weights = gpt.make_model(seed=5, layers=2, width=64, heads=4, context=SEQUENCE).state_dict()
    with zinf.torch.GatheredParameters(list(model.parameters()), modifier_rank=root):
        if rank == root:
            model.load_state_dict(weights)
    engine, _, _, _ = zinf.torch.initialize(model=model, config=config)
    worst = max((engine.read_parameter(name) - weights[name]).abs().max().item()
                for name in engine._names.values())
    with open(os.path.join(out_dir, f"init_write.rank{engine.global_rank}.json"), "w") as f:
        json.dump({"worst": worst}, f)


class Boom(RuntimeError):
    pass


def fail(out_dir, timeout_ms, where):
    """Rank 1 raises at step 1: in the backward of lm_head (inside engine.backward()), or in the
    training loop between the engine's calls (where="loop")."""
    config = zinf_config(3, "cpu", "cpu", os.path.join(out_dir, "nvme"),
                         stage3_param_persistence_threshold=0)
    config["zinf"]["collective_timeout_ms"] = timeout_ms
    model = make_model()
    engine, _, _, _ = zinf.torch.initialize(model=model, config=config,
                                            model_parameters=model.parameters())
    rank, world = engine.global_rank, engine.world_size
    step = 0

    def explode(module, grad_input, grad_output):
        if where == "backward" and rank == 1 and step == 1:
            print(f"rank 1 raises at {time.time():.3f}", flush=True)
            raise Boom("injected failure in the backward of lm_head")

    model.lm_head.register_full_backward_hook(explode)
    for step, batch in enumerate(make_batches(3)):
        if where == "loop" and rank == 1 and step == 1:
            print(f"rank 1 raises at {time.time():.3f}", flush=True)
            raise Boom("injected failure in the training loop")
        ids, labels = shard(batch, rank, world)
        loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        engine.step()
    print(f"rank {rank}: finished all steps", flush=True)


def loader(out_dir):
    dataset = torch.utils.data.TensorDataset(torch.arange(40, dtype=torch.float32).unsqueeze(1))
    engine, _, data, _ = zinf.torch.initialize(model=make_model(), config=zinf_config(2),
                                               training_data=dataset)
    passes = [[int(v) for (x,) in data for v in x.flatten()] for _ in range(2)]
    with open(os.path.join(out_dir, f"loader.rank{engine.global_rank}.json"), "w") as f:
        json.dump({"world_size": engine.world_size, "passes": passes}, f)


def consolidated(out_dir):
    config = zinf_config(3, "cpu", "cpu", bf16=True, stage3_param_persistence_threshold=0)
    model = make_model()
    engine, _, _, _ = zinf.torch.initialize(model=model, config=config)
    rank, world = engine.global_rank, engine.world_size
    ids, labels = shard(make_batches(1)[0], rank, world)
    engine.backward(engine(input_ids=ids, labels=labels).loss)
    engine.step()
    state = engine._zero3_consolidated_16bit_state_dict()
    masters = {name: engine.read_parameter(name) for name, _ in model.named_parameters()}
    if rank == 0:
        torch.save(state, os.path.join(out_dir, "consolidated.pt"))
        torch.save(masters, os.path.join(out_dir, "masters.pt"))
    else:
        with open(os.path.join(out_dir, f"consolidated.rank{rank}.json"), "w") as f:
            json.dump({"none": state is None}, f)


def several(out_dir, cases):
    oracle(out_dir, cases)

    def folder(name):
        path = os.path.join(out_dir, name)
        os.makedirs(path, exist_ok=True)
        return path

    write(folder("write"))
    init_write(folder("init_write0"), 0)
    init_write(folder("init_write1"), 1)
    loader(folder("loader"))
    consolidated(folder("consolidated"))


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "oracle":
        oracle(sys.argv[2], sys.argv[3:])
    elif sys.argv[1] == "write":
        write(sys.argv[2])
    elif sys.argv[1] == "loader":
        loader(sys.argv[2])
    elif sys.argv[1] == "init_write":
        init_write(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1] == "consolidated":
        consolidated(sys.argv[2])
    elif sys.argv[1] == "several":
        several(sys.argv[2], sys.argv[3:])
    else:
        fail(sys.argv[2], int(sys.argv[3]), sys.argv[4])
