"""Run by test_init_ranks.py under mpirun or torchrun (one process per rank), or alone (one
process): models built under zinf.torch.Init with torch.distributed initialised
(deepspeed.init_distributed()), changed on one rank inside GatheredParameters(modifier_rank=r)
and read on every rank before initialize().

    mpirun -np 2 python init_ranks.py <out_dir> <model_dir> [write] [resize]
    python -m torch.distributed.run --nproc_per_node 2 init_ranks.py <out_dir> <model_dir> ...
    python init_ranks.py <out_dir> <model_dir> resize
    mpirun -np 2 python init_ranks.py <out_dir> - errors

write: init_model's Stack and a bf16 Linear, each rank drawing them with a seed of its own; rank
0 loads WRITE_SEED's weights into all of them inside GatheredParameters(modifier_rank=0), and
rank 1 sets the head's bias to 0.25 inside GatheredParameters(modifier_rank=1); then every rank
reads them all in GatheredParameters(modifier_rank=None) and initializes an engine with the
Stack. Writes <out_dir>/write.rank<r>.pt: what the rank read ("seen"), the engine's fp32
masters ("masters"), the messages of the RuntimeWarnings raised from the first block on
("warnings") and the error of a block with modifier_rank=2 ("refused").
resize: DeepSpeed-Chat's start under zinf.deepspeed_compat: HfDeepSpeedConfig at stage 3,
from_pretrained(<model_dir>) (weights loaded on rank 0 inside GatheredParameters(modifier_rank=0)),
resize_token_embeddings(NEW_VOCAB) (new rows drawn from the old embeddings' mean and covariance,
read on every rank), deepspeed.initialize. Writes <out_dir>/resize.w<world>.rank<r>.pt: the
engine's masters and the warnings, or initialize()'s error.
errors (torch.distributed's timeout 20 s, so that a rank left waiting fails fast): a Linear
built under Init, each rank drawing it with a seed of its own, then GatheredParameters(
modifier_rank=0) blocks that end badly on one rank: "shape", rank 0 replaces the weight's .data
with a tensor of another shape; "raise_other", rank 0 sets the bias to seeded random values and
the block raises on rank 1; "raise_root", rank 0 sets the bias, then the block raises on rank 0.
Writes <out_dir>/errors.rank<r>.pt: for each, the message of what the block raised on the rank
(or None), the seconds it took, the torch.distributed broadcasts its end made ("broadcasts")
and the Linear's values read after it ("after"); also the
values read before the first ("before") and those rank 0 set in raise_other ("set")."""
import datetime
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zinf.deepspeed_compat  # noqa: E402
import zinf.torch  # noqa: E402
from init_model import Stack, config  # noqa: E402

WIDTH, LAYERS = 16, 2
WRITE_SEED = 100
NEW_VOCAB = 110


def write_weights():
    """The weights rank 0 loads: the Stack's and the bf16 Linear's, drawn with WRITE_SEED."""
    torch.manual_seed(WRITE_SEED)
    return Stack(WIDTH, LAYERS).state_dict(), torch.nn.Linear(8, 4, dtype=torch.bfloat16)


def write(out_dir, rank):
    cfg = config(out_dir, WIDTH, offload="cpu")
    torch.manual_seed(5 + rank)
    with zinf.torch.Init(config=cfg):
        model = Stack(WIDTH, LAYERS)
        half = torch.nn.Linear(8, 4, dtype=torch.bfloat16)
    weights, half_weights = write_weights()
    params = list(model.parameters()) + list(half.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # In another order than the model's on rank 1: the block puts them in one.
        with zinf.torch.GatheredParameters(params if rank == 0 else params[::-1],
                                           modifier_rank=0):
            if rank == 0:
                model.load_state_dict(weights)
                half.load_state_dict(half_weights.state_dict())
        with zinf.torch.GatheredParameters(model.head.bias, modifier_rank=1):
            if rank == 1:
                model.head.bias.data.fill_(0.25)
        with zinf.torch.GatheredParameters(params):
            seen = {n: p.detach().clone() for n, p in model.named_parameters()}
            seen.update({f"half.{n}": p.detach().clone() for n, p in half.named_parameters()})
        try:
            with zinf.torch.GatheredParameters(params, modifier_rank=2):
                pass
            refused = None
        except ValueError as e:
            refused = str(e)
    engine, _, _, _ = zinf.torch.initialize(model=model, config=cfg)
    masters = {n: engine.read_parameter(n) for n, _ in model.named_parameters()}
    engine.destroy()
    torch.save({"seen": seen, "masters": masters, "refused": refused,
                "warnings": [str(w.message) for w in caught if w.category is RuntimeWarning]},
               os.path.join(out_dir, f"write.rank{rank}.pt"))


def resize(out_dir, model_dir, rank, world_size):
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    cfg = {"train_micro_batch_size_per_gpu": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "zinf": {"cpu_threads": 1}}
    torch.manual_seed(1234)
    report = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf_config = HfDeepSpeedConfig(cfg)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        model.resize_token_embeddings(NEW_VOCAB)
        try:
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                              config=cfg)
            report["masters"] = {n: engine.read_parameter(n)
                                 for n, _ in model.named_parameters()}
            engine.destroy()
        except zinf.torch.Error as e:
            report["error"] = str(e)
        del hf_config
    report["warnings"] = [str(w.message) for w in caught
                          if str(w.message).startswith("GatheredParameters")]
    torch.save(report, os.path.join(out_dir, f"resize.w{world_size}.rank{rank}.pt"))


def errors(out_dir, rank):
    cfg = config(out_dir, WIDTH, offload="cpu")
    torch.manual_seed(5 + rank)
    with zinf.torch.Init(config=cfg):
        lin = torch.nn.Linear(WIDTH, 4)
    params = list(lin.parameters())

    def read():
        with zinf.torch.GatheredParameters(params):
            return {n: p.detach().clone() for n, p in lin.named_parameters()}

    generator = torch.Generator().manual_seed(40)
    values = torch.randn(4, generator=generator)

    def shape():
        if rank == 0:
            lin.weight.data = torch.randn(2, 2, generator=generator)

    def raise_other():
        if rank == 0:
            lin.bias.data.copy_(values)
        else:
            raise RuntimeError("the block fails on rank 1")

    def raise_root():
        if rank == 0:
            lin.bias.data.copy_(-values)
            raise RuntimeError("the block fails on rank 0")

    # The broadcasts each block's end makes, counted under both of torch.distributed's names
    # (broadcast_object_list calls the module's own).
    c10d = torch.distributed.distributed_c10d
    original = c10d.broadcast
    broadcasts = [0]

    def counted(*args, **kwargs):
        broadcasts[0] += 1
        return original(*args, **kwargs)

    report = {"before": read(), "set": values}
    for name, body in (("shape", shape), ("raise_other", raise_other),
                       ("raise_root", raise_root)):
        started = time.perf_counter()
        error = None
        broadcasts[0] = 0
        c10d.broadcast = torch.distributed.broadcast = counted
        try:
            with zinf.torch.GatheredParameters(params, modifier_rank=0):
                body()
        except (ValueError, RuntimeError) as e:
            error = str(e)
        finally:
            c10d.broadcast = torch.distributed.broadcast = original
        report[name] = {"error": error, "seconds": time.perf_counter() - started,
                        "after": read(), "broadcasts": broadcasts[0]}
    torch.save(report, os.path.join(out_dir, f"errors.rank{rank}.pt"))
    # Both ranks leave together, the group closed first (a rank whose peer had exited while its
    # group was open was seen to abort at exit).
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    zinf.deepspeed_compat.install()
    short = {"timeout": datetime.timedelta(seconds=20)} if "errors" in sys.argv[3:] else {}
    zinf.deepspeed_compat.init_distributed(**short)
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out, model_dir = sys.argv[1], sys.argv[2]
    if "write" in sys.argv[3:]:
        write(out, rank)
    if "resize" in sys.argv[3:]:
        resize(out, model_dir, rank, world_size)
    if "errors" in sys.argv[3:]:
        errors(out, rank)
