"""An ordinary Hugging Face Trainer script, the one line of zinf.deepspeed_compat.install() added,
its training a function so that one process can run several: test_hf_trainer.py runs it in fresh
processes (transformers must be imported after install(), and a job's launcher and environment
are the process's), each training several cases one after another where the environment allows.

    hf_trainer_run.py OUT [--ds CONFIG.json] [--ga N] [--batch N] [--steps N] [--save-steps N]
                          [--resume CHECKPOINT] [--from-config] [--freeze] [--lora] [--gc]
                          [--eval] [--device-default]
    hf_trainer_run.py --cases CASES.json    (each [OUT, option, ...] of the list, in order)
    mpirun -np 2 python hf_trainer_run.py OUT ...     (the same script, one process per rank)

Trains a 2-layer GPT-2 (vocabulary 256, width 32, no dropout) on seeded random tokens with AdamW
made by the Trainer, a linear schedule with warm-up, on the CPU (use_cpu=True unless
--device-default), --batch samples a micro-batch on each process; saves the model with
save_model() to OUT/final; prints one line "RESULT <json>", and writes it to
OUT/result.rank<r>.json, with the per-step loss, gradient norm and learning rate the Trainer
logged, with --eval the evaluation loss at each save, and this process's rank and the world
size as the Trainer sees them. Between cases the script clears the process-wide state a Trainer
leaves behind: Accelerate's shared states, transformers' DeepSpeed config reference
(unset_hf_deepspeed_config, transformers' function for that) and the environment variables a
case set (Accelerate's ACCELERATE_USE_DEEPSPEED); the torch.distributed group, once
made, stays, as a launcher's processes keep it. With --cases outside a launcher's job, a
case that raises writes its traceback to OUT/error.txt and the next case runs."""
import argparse
import json
import os
import sys
import traceback

import zinf.deepspeed_compat

zinf.deepspeed_compat.install()

import torch  # noqa: E402
from transformers import (AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel,  # noqa: E402
                          Trainer, TrainerCallback, TrainingArguments)

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--ds")
parser.add_argument("--ga", type=int, default=1)
parser.add_argument("--batch", type=int, default=4, help="per-device micro-batch")
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--save-steps", type=int, default=3)
parser.add_argument("--resume")
parser.add_argument("--from-config", action="store_true")
parser.add_argument("--freeze", action="store_true")
parser.add_argument("--lora", action="store_true", help="peft LoRA adapters on c_attn")
parser.add_argument("--gc", action="store_true", help="gradient checkpointing")
parser.add_argument("--eval", action="store_true", help="evaluate at every save")
parser.add_argument("--device-default", action="store_true",
                    help="no use_cpu=True: Accelerate picks the device")
torch.set_num_threads(1)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, sample_count=48, sequence=16, seed=1234):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 256, (sample_count, sequence), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class Losses(TrainerCallback):
    def __init__(self):
        self.rows = []
        self.eval_rows = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.rows.append([state.global_step, logs["loss"], logs.get("grad_norm"),
                              logs.get("learning_rate")])
        if logs and "eval_loss" in logs:
            self.eval_rows.append([state.global_step, logs["eval_loss"]])


def train(argv):
    """One training, as the script without --cases runs it."""
    options = parser.parse_args(argv)
    args = TrainingArguments(
        output_dir=options.out, deepspeed=options.ds, max_steps=options.steps,
        per_device_train_batch_size=options.batch, gradient_accumulation_steps=options.ga,
        learning_rate=3e-3, weight_decay=0.01, warmup_steps=2, max_grad_norm=1.0, logging_steps=1,
        save_strategy="steps", save_steps=options.save_steps, report_to=[], seed=42,
        eval_strategy="steps" if options.eval else "no", eval_steps=options.save_steps,
        gradient_checkpointing=options.gc, dataloader_num_workers=0,
        use_cpu=not options.device_default, disable_tqdm=True)
    config = GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=2, n_positions=16,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                        eos_token_id=0)
    torch.manual_seed(0)
    model = (AutoModelForCausalLM.from_config(config) if options.from_config
             else GPT2LMHeadModel(config))
    if options.freeze:
        model.transformer.wte.weight.requires_grad_(False)
    if options.lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8,
                                                           target_modules=["c_attn"],
                                                           fan_in_fan_out=True))
    losses = Losses()
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(),
                      eval_dataset=Tokens(8, seed=99) if options.eval else None,
                      callbacks=[losses])
    assert trainer.is_deepspeed_enabled == (options.ds is not None)
    result = trainer.train(resume_from_checkpoint=options.resume)
    trainer.save_model(options.out + "/final")
    report = json.dumps({"losses": losses.rows, "eval_losses": losses.eval_rows,
                         "train_loss": result.training_loss, "rank": args.process_index,
                         "world_size": args.world_size})
    with open(f"{options.out}/result.rank{args.process_index}.json", "w") as file:
        file.write(report)
    print("RESULT " + report)


def clear_process_state():
    from accelerate.state import AcceleratorState, GradientState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    unset_hf_deepspeed_config()


if len(sys.argv) == 3 and sys.argv[1] == "--cases":
    with open(sys.argv[2]) as file:
        cases = json.load(file)
    environment = dict(os.environ)
    for case in cases:
        try:
            train([str(part) for part in case])
        except (Exception, SystemExit):
            if "WORLD_SIZE" in os.environ or "OMPI_COMM_WORLD_SIZE" in os.environ:
                raise  # in a launcher's job the other ranks would wait for this one
            os.makedirs(case[0], exist_ok=True)
            with open(os.path.join(case[0], "error.txt"), "w") as file:
                file.write(traceback.format_exc())
            print(f"case {case} failed:\n{traceback.format_exc()}", file=sys.stderr)
        clear_process_state()
        # Accelerate sets ACCELERATE_USE_DEEPSPEED for a DeepSpeed run: the next case starts
        # from the environment the process started with.
        os.environ.clear()
        os.environ.update(environment)
else:
    train(sys.argv[1:])
