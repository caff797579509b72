#!/usr/bin/env python3
"""scripts/trace-timeline draws, per row, one span for every span of the trace inside its window.

1. A hand-written trace of two steps (and parts of a first and a fourth that lie outside the
   window): the rows, their order and how many spans each draws are written out below, by hand.
2. With a train_lm binary: a real trace of 3 overlapped steps with the state on NVMe. The spans
   drawn on each track are counted against the trace itself (every "X" span of that track that
   meets the window the SVG states), the read and update rows about as many spans (a read runs
   ahead of its update by at most the pool's blocks), and the pass of step 2 is drawn beside the
   forward of step 3.

Usage: trace_timeline_test.py <repo root> <scratch dir> [<train_lm binary>]
"""
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

SVG = "{http://www.w3.org/2000/svg}"


def drawn_rows(svg_path):
    """[(row label, track, [(x, width), ...])] in drawing order, and the window in microseconds."""
    root = ET.parse(svg_path).getroot()
    rows = []
    for g in root.iter(SVG + "g"):
        if g.get("class") != "row":
            continue
        spans = [(float(r.get("x")), float(r.get("width"))) for r in g.iter(SVG + "rect")
                 if r.get("class") == "span"]
        rows.append((g.get("data-row"), g.get("data-track"), spans))
    return rows, float(root.get("data-start-us")), float(root.get("data-end-us"))


def run_script(repo, trace, svg, *extra):
    out = subprocess.run([sys.executable, os.path.join(repo, "scripts", "trace-timeline"), trace,
                          "-o", svg, *extra], capture_output=True, text=True)
    print(out.stdout, end="")
    if out.returncode != 0:
        sys.exit(f"trace-timeline failed ({out.returncode}): {out.stderr}")


def check(cond, message):
    if not cond:
        sys.exit("FAILED: " + message)


def meta(tid, name, sort_index):
    return [{"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": name}},
            {"ph": "M", "pid": 1, "tid": tid, "name": "thread_sort_index",
             "args": {"sort_index": sort_index}}]


def span(tid, name, ts, dur):
    return {"ph": "X", "pid": 1, "tid": tid, "name": name, "ts": ts, "dur": dur}


def hand_written(repo, scratch):
    # Tracks as train_lm writes them: engine 0, read 1, update 2, write 3, step 4, program 5.
    ev = []
    for tid, name in enumerate(["rank0 engine", "read", "update", "write", "rank0 step",
                                "train_lm rank 0"]):
        ev += meta(tid, name, tid)
    # Step 1 (before the window): forward 0-100, backward 100-200, pass 210-400.
    ev += [span(5, "forward", 0, 100), span(5, "backward", 100, 100),
           span(4, "step optimizer", 210, 190), span(1, "read sg0", 215, 20)]
    # Step 2 (window starts at its forward, 1000): forward 1000-1100 beside pass 1's write sg1
    # (950-1020, crosses the window's start: drawn, clipped), gathers of two modules
    # (issue, wait, release: 6 spans), a reduction, backward 1100-1300, step spans, pass 2
    # (1320-1700) with two sub-groups read, updated, written.
    ev += [span(3, "write sg1", 950, 70), span(5, "forward", 1000, 100)]
    for m, t in (("embed", 1005), ("block0", 1040)):
        ev += [span(0, "issue " + m, t, 0), span(0, "wait " + m, t + 1, 10),
               span(0, "release " + m, t + 30, 0)]
    ev += [span(5, "backward", 1100, 200), span(0, "reduce block0", 1150, 40),
           span(0, "step reduce", 1300, 5), span(0, "step norm", 1305, 10),
           span(4, "step optimizer", 1320, 380), span(4, "step publish", 1700, 1)]
    for sg, t in ((0, 1320), (1, 1400)):
        ev += [span(1, f"read sg{sg}", t, 50), span(2, f"update sg{sg}", t + 50, 10),
               span(3, f"write sg{sg}", t + 60, 40)]
    # Step 3: forward 1500-1600 beside pass 2, one gather, backward 1600-1800, its pass
    # 1810-2000 (the window ends there: the third "step optimizer" span).
    ev += [span(5, "forward", 1500, 100), span(0, "wait embed", 1510, 20),
           span(5, "backward", 1600, 200), span(0, "step norm", 1800, 5),
           span(4, "step optimizer", 1810, 190), span(1, "read sg0", 1810, 60),
           span(2, "update sg0", 1870, 10), span(3, "write sg0", 1880, 60)]
    # Step 4, after the window: none of it is drawn.
    ev += [span(5, "forward", 2100, 100), span(0, "wait embed", 2110, 20),
           span(1, "read sg0", 2150, 30)]
    trace = os.path.join(scratch, "hand_written.json")
    with open(trace, "w") as f:
        json.dump({"traceEvents": ev, "displayTimeUnit": "ms"}, f)
    svg = os.path.join(scratch, "hand_written.svg")
    run_script(repo, trace, svg, "--steps", "2:3")
    rows, start, end = drawn_rows(svg)
    got = [(label, len(spans)) for label, _, spans in rows]
    want = [("train_lm rank 0", 4),        # forward 2, backward 2, forward 3, backward 3
            ("rank0 engine: gather", 7),   # 2 x (issue, wait, release) + wait embed of step 3
            ("rank0 engine: reduce", 1),
            ("rank0 engine: step", 3),     # step reduce, step norm; step norm of step 3
            ("rank0 step", 3),             # optimizer 2, publish 2, optimizer 3
            ("read", 3), ("update", 3), ("write", 4)]  # write sg1 of pass 1 crosses the start
    check(got == want, f"rows {got}, expected {want}")
    check((start, end) == (1000.0, 2000.0), f"window {start}-{end} us, expected 1000-2000")
    # The clipped write starts at the left edge; a zero-length span is drawn 1 px wide.
    by_label = {label: spans for label, _, spans in rows}
    left = min(x for _, _, spans in rows for x, _ in spans)
    check(min(x for x, _ in by_label["write"]) == left == by_label["train_lm rank 0"][0][0],
          "the write crossing the window's start is not clipped to it")
    gathers = by_label["rank0 engine: gather"]
    check(min(w for _, w in gathers) == 1.0, "a zero-length issue or release is not 1 px wide")
    print("hand-written trace: rows and span counts as expected")


def real_trace(repo, scratch, train_lm):
    trace = os.path.join(scratch, "train_lm_trace.json")
    cmd = [train_lm, "--params", "2M", "--steps", "3", "--batch", "2", "--seq-len", "16",
           "--eval-every", "3", "--eval-tokens", "64", "--seed", "3", "--no-progress",
           "--offload-optimizer", "nvme", "--sub-group-size", "65536", "--overlap-step", "on",
           "--trace", trace, "--out", os.path.join(scratch, "out"),
           "--nvme-path", os.path.join(scratch, "nvme")]
    out = subprocess.run(cmd, capture_output=True, text=True)
    check(out.returncode == 0, f"train_lm failed: {out.stderr[-2000:]}")
    svg = os.path.join(scratch, "train_lm_trace.svg")
    run_script(repo, trace, svg, "--steps", "2:3")
    rows, start, end = drawn_rows(svg)
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    expected = {}
    for e in events:
        if e.get("ph") == "X" and e["ts"] <= end and e["ts"] + e["dur"] >= start:
            expected[names[e["tid"]]] = expected.get(names[e["tid"]], 0) + 1
    drawn = {}
    for _, track, spans in rows:
        drawn[track] = drawn.get(track, 0) + len(spans)
    print(f"train_lm trace, spans per track in the window: trace {expected}, drawn {drawn}")
    check(drawn == expected, f"drawn {drawn}, the trace has {expected}")
    by_label = {label: spans for label, _, spans in rows}
    for label in ("read", "update", "write", "train_lm rank 0"):
        check(label in by_label, f"no row {label}")
    # A sub-group's read comes before its update by at most the pool's 4 blocks (train_lm's
    # offload_optimizer.buffer_count; with clipping a pass reads them ahead during the backward),
    # so at the window's two edges the rows differ by at most 4 spans each.
    reads, updates = len(by_label["read"]), len(by_label["update"])
    check(updates > 0 and abs(reads - updates) <= 8, f"read {reads} spans, update {updates}")
    # Overlap: some read span of the pass lies beside the program's last forward span drawn.
    forward = [e for e in events if e.get("ph") == "X" and e["name"] == "forward"]
    f3 = sorted(forward, key=lambda e: e["ts"])[2]
    reads = [e for e in events if e.get("ph") == "X" and e["name"].startswith("read sg")
             and e["ts"] < f3["ts"] + f3["dur"] and e["ts"] + e["dur"] > f3["ts"]]
    check(reads, "no read span of the pass beside the forward of step 3")
    print(f"train_lm trace: {len(reads)} read spans beside the forward of step 3")


def main():
    repo, scratch = sys.argv[1], sys.argv[2]
    os.makedirs(scratch, exist_ok=True)
    hand_written(repo, scratch)
    if len(sys.argv) > 3:
        real_trace(repo, scratch, sys.argv[3])
    print("PASSED")


if __name__ == "__main__":
    main()
