#!/usr/bin/env python3
"""Reads compare_1b.sh's output file and prints, per round and variant, the time of the chosen
steps (validation left out), their optimizer phase ("step" in --step-times: the AdamW + NVMe pass
and its publish) and compute (forward + backward + gather + reduce), and then for each variant
against the reference (--ref, default the first variant of round 1): the per-round ratios of
step time and optimizer phase with their medians, the variant's step time over max(compute,
optimizer) of the reference in the same round, and the difference in peak RSS; first, the
reference's own step time over its max(compute, optimizer), the most that overlapping the two
phases can gain over it. Where the lines
carry the process's CPU seconds ("cpu"), also the variant's step time over the CPU's limit,
max(compute, optimizer, CPU seconds of the reference / cores): on a machine whose cores both
compute and run the optimizer, no schedule of the same work is faster than its CPU seconds
spread over every core.

  compare_1b.py FILE [--steps 2,3] [--ref NAME] [--cores N]
"""
import argparse
import os
import re
import statistics

STEP = re.compile(r"step (\d+): ([\d.]+)s = forward ([\d.]+)s \+ backward ([\d.]+)s \+ gather "
                  r"([\d.]+)s \+ reduce ([\d.]+)s \+ step ([\d.]+)s .* \+ eval ([\d.]+)s")
CPU = re.compile(r".*; cpu ([\d.]+)s$")


def parse(path):
    runs, cur = [], None
    for line in open(path):
        if m := re.match(r"round (\d+) (\S+) load ([\d.]+)", line):
            cur = {"round": int(m[1]), "name": m[2], "load": float(m[3]), "steps": {}, "rss": None}
            runs.append(cur)
        elif (m := STEP.match(line)) and cur is not None:
            total, fwd, bwd, gather, reduce, step, evaluation = (float(x) for x in m.groups()[1:])
            cpu = CPU.match(line.rstrip())
            cur["steps"][int(m[1])] = {"time": total - evaluation, "optimizer": step,
                                       "compute": fwd + bwd + gather + reduce,
                                       "cpu": float(cpu[1]) if cpu else None}
        elif (m := re.match(r"wall .* maxrss (\d+) kB", line)) and cur is not None:
            cur["rss"] = int(m[1]) * 1024
    return runs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("file")
    parser.add_argument("--steps", default="2,3")
    parser.add_argument("--ref")
    parser.add_argument("--cores", type=int, default=os.cpu_count())
    args = parser.parse_args()
    steps = [int(s) for s in args.steps.split(",")]
    runs = parse(args.file)
    if not runs:
        raise SystemExit(f"{args.file}: no runs")
    ref = args.ref or runs[0]["name"]
    if ref not in {run["name"] for run in runs}:
        raise SystemExit(f"{args.file}: --ref {ref}: no such variant")
    table = {}
    for run in runs:
        missing = [s for s in steps if s not in run["steps"]]
        if missing:
            raise SystemExit(f"{args.file}: round {run['round']} {run['name']} has no step {missing}")
        sums = {k: sum(run["steps"][s][k] for s in steps) for k in ("time", "optimizer", "compute")}
        cpus = [run["steps"][s]["cpu"] for s in steps]
        sums["cpu"] = None if None in cpus else sum(cpus)
        table[(run["round"], run["name"])] = {**sums, "rss": run["rss"], "load": run["load"]}
        cpu = "" if sums["cpu"] is None else f", CPU {sums['cpu']:.2f} s"
        print(f"round {run['round']} {run['name']:>6} (load {run['load']:.2f}): steps "
              f"{args.steps} {sums['time']:.2f} s, optimizer phase {sums['optimizer']:.2f} s, "
              f"compute {sums['compute']:.2f} s{cpu}, peak RSS {run['rss'] / 2**30:.3f} GiB")
    rounds = sorted({r for r, _ in table})
    names = list(dict.fromkeys(run["name"] for run in runs))
    # The most a schedule that overlaps the two phases can gain over the reference: its step
    # time over the longer of its compute and optimizer phases.
    limit = [table[(r, ref)]["time"] / max(table[(r, ref)]["compute"], table[(r, ref)]["optimizer"])
             for r in rounds if (r, ref) in table]
    print(f"{ref} over max(compute, optimizer) of {ref}, the most any overlap gains: "
          f"{', '.join(f'{x:.3f}' for x in limit)} (median {statistics.median(limit):.3f})")
    for name in names:
        if name == ref:
            continue
        time, optimizer, over_max, over_cpu, rss = [], [], [], [], []
        for r in rounds:
            a, b = table.get((r, ref)), table.get((r, name))
            if a is None or b is None:
                continue
            time.append(b["time"] / a["time"])
            optimizer.append(b["optimizer"] / a["optimizer"])
            over_max.append(b["time"] / max(a["compute"], a["optimizer"]))
            if a["cpu"] is not None:
                over_cpu.append(b["time"] / max(a["compute"], a["optimizer"], a["cpu"] / args.cores))
            rss.append((b["rss"] - a["rss"]) / 2**20)
        fmt = lambda xs: ", ".join(f"{x:.3f}" for x in xs)
        print(f"{name} / {ref}: step time {fmt(time)} (median {statistics.median(time):.3f}); "
              f"optimizer phase {fmt(optimizer)} (median {statistics.median(optimizer):.3f}); "
              f"{name} over max(compute, optimizer) of {ref} {fmt(over_max)} "
              f"(median {statistics.median(over_max):.3f}); peak RSS {name} - {ref} "
              f"{', '.join(f'{x:+.1f}' for x in rss)} MiB")
        if over_cpu:
            print(f"  {name} over max(compute, optimizer, CPU seconds / {args.cores} cores) of "
                  f"{ref}: {fmt(over_cpu)} (median {statistics.median(over_cpu):.3f})")


if __name__ == "__main__":
    main()
