#!/usr/bin/env python3
"""The planner's step against compare_1b.sh's measured steps, round by round: for each round it
takes the machine's rates that `zinf plan --step-only --measure --json` measured at the start of
that round (compare_1b.sh's ROUND_CMD wrote them to PLAN_JSON, "{round}" standing for the round)
and the reference (sequential) run's compute of that round, and asks the planner for the step
with those rates and that compute: overlapped (`--compute-s S --host-compute`, the compute on
this machine's cores) against the variant's measured step, and sequential (`--no-overlap-step`)
against the reference's. Prints per-round predicted / measured and the medians.

  plan_vs_1b.py OUT_FILE PLAN_JSON --zinf build/bin/zinf --ref off --variant on \\
      [--steps 2,3,4] -- ZINF_PLAN_STEP_ONLY_FLAGS...
"""
import argparse
import json
import statistics
import subprocess

from compare_1b import parse


def predict(zinf, flags, profile, compute_s, overlap):
    rates = ["--mem-adam-gbps", profile["mem_adam_gbps"], "--nvme-read-gbps",
             profile["nvme_read_gbps"], "--nvme-write-gbps", profile["nvme_write_gbps"],
             "--nvme-duplex-gbps", profile["nvme_duplex_gbps"]]
    cmd = [zinf, "plan", "--step-only", *flags, *[str(x) for x in rates], "--compute-s",
           str(compute_s), "--json"]
    cmd += ["--host-compute"] if overlap else ["--no-overlap-step"]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("file")
    parser.add_argument("plan_json")
    parser.add_argument("--zinf", default="build/bin/zinf")
    parser.add_argument("--ref", required=True)
    parser.add_argument("--variant", required=True)
    parser.add_argument("--steps", default="2,3,4")
    # The rest (after "--") are zinf plan's flags.
    args, rest = parser.parse_known_args()
    flags = [f for f in rest if f != "--"]
    steps = [int(s) for s in args.steps.split(",")]
    runs = {(r["round"], r["name"]): r for r in parse(args.file)}
    over, seq = [], []
    for rnd in sorted({r for r, _ in runs}):
        ref, var = runs.get((rnd, args.ref)), runs.get((rnd, args.variant))
        if ref is None or var is None:
            continue
        mean = lambda run, key: statistics.mean(run["steps"][s][key] for s in steps)
        compute = mean(ref, "compute")
        profile = json.load(open(args.plan_json.format(round=rnd)))["profile"]
        on = predict(args.zinf, flags, profile, compute, overlap=True)
        off = predict(args.zinf, flags, profile, compute, overlap=False)
        over.append(on["step_s"] / mean(var, "time"))
        seq.append(off["step_s"] / mean(ref, "time"))
        print(f"round {rnd}: rates read {profile['nvme_read_gbps']:.2f} write "
              f"{profile['nvme_write_gbps']:.2f} duplex {profile['nvme_duplex_gbps']:.2f} memory "
              f"{profile['mem_adam_gbps']:.1f} GB/s; {args.ref} compute {compute:.2f} s a step; "
              f"predicted optimizer step {on['optimizer_step_s']:.2f} s (measured "
              f"{mean(ref, 'optimizer'):.2f}), {args.variant} step {on['step_s']:.2f} s (measured "
              f"{mean(var, 'time'):.2f}), {args.ref} step {off['step_s']:.2f} s (measured "
              f"{mean(ref, 'time'):.2f})")
    fmt = lambda xs: ", ".join(f"{x:.3f}" for x in xs)
    print(f"predicted / measured, {args.variant} (overlapped): {fmt(over)} (median "
          f"{statistics.median(over):.3f}); {args.ref} (sequential): {fmt(seq)} (median "
          f"{statistics.median(seq):.3f})")


if __name__ == "__main__":
    main()
