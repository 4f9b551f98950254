"""Read a torch.profiler trace (05's --profile writes one per rank) and show when each all-reduce ran against backward.

  torchrun --nproc_per_node=2 05_manual_ddp_gpt2.py --profile traces ...   (a trace of steps 3-5 per rank)
  python benchmarks/overlap.py traces/trace_rank0.json [--json overlap.json]

For every profiled step: the span of backward (the autograd engine's first to last function), and each all-reduce
launched in the step, with when it was launched and when gloo worked on it, in ms from the step's start (gloo
traces only: an NCCL trace is refused, see main).
An all-reduce that finished before backward's last function began was hidden behind backward's compute: the point
of buckets and hooks. The last line counts them; exit status 1 if there were none (no overlap at all: one bucket, or a
whole-model torch.compile, which hands over every gradient only when its whole backward is done).
No torch needed: the trace is JSON.
"""

import argparse
import json
import sys


def ms(t, t0):
    """Microseconds since the profiler started -> ms since t0, to 0.1 ms."""
    return round((t - t0) / 1e3, 1)


def spans(events, name_is):
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events if name_is(e["name"]))


def steps(trace):
    """[(step name, step start, backward (start, end), launches [start], collective work [(start, end)])]."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    out = []
    for step in sorted((e for e in events if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"]):
        start, end = step["ts"], step["ts"] + step["dur"]
        inside = [e for e in events if start <= e["ts"] < end]
        backward = spans(inside, lambda n: n.startswith("autograd::engine::evaluate_function"))
        if not backward:
            continue
        launches = [s for s, _ in spans(inside, lambda n: n.startswith("c10d::allreduce"))]
        work = spans(inside, lambda n: n.endswith(":all_reduce") or n.startswith("nccl:all_reduce"))
        out.append((step["name"], start, (backward[0][0], backward[-1][0], max(e for _, e in backward)), launches,
                    work))
    return out


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="a chrome trace JSON from torch.profiler")
    p.add_argument("--json", default=None, help="also write the numbers here")
    args = p.parse_args()
    try:
        with open(args.trace) as f:
            trace = json.load(f)
        found = steps(trace)
    except (OSError, ValueError, KeyError, TypeError) as e:
        fail(f"{args.trace}: not a readable profiler trace ({type(e).__name__}: {e})")
    if any("nccl" in str(e.get("name", "")).lower() for e in trace["traceEvents"]):
        # NCCL's CPU-side span ends when its kernel is queued, so every all-reduce would look hidden: the overlap
        # is on the GPU's timeline, between the NCCL kernels and backward's, which this reader does not pair up.
        fail(f"{args.trace}: an NCCL trace; its CPU-side spans end at launch and cannot show overlap: open it in "
             "Perfetto and compare the ncclDevKernel rows with backward's kernels on the GPU's streams")
    if not found:
        fail(f"{args.trace}: no profiled step with a backward in it")
    hidden = total = 0
    report = []
    for name, t0, (b0, last, b1), launches, work in found:
        inside = sum(1 for s in launches if b0 <= s < b1)
        done = sum(1 for s, e in work if b0 <= s and e < last)  # with backward work still to come
        hidden, total = hidden + done, total + len(launches)
        row = {"step": name, "backward_ms": [ms(b0, t0), ms(b1, t0)], "launched_ms": [ms(s, t0) for s in launches],
               "worked_ms": [[ms(s, t0), ms(e, t0)] for s, e in work], "launched_inside_backward": inside,
               "finished_inside_backward": done}
        print(f"{name}: backward {row['backward_ms'][0]:g}-{row['backward_ms'][1]:g} ms from the step's start; "
              f"{inside} of {len(launches)} all-reduces launched inside it, {done} finished before its last function")
        print("  launched at: " + " ".join(f"{t:g}" for t in row["launched_ms"]))
        print("  worked:      " + " ".join(f"{s:g}-{e:g}" for s, e in row["worked_ms"]))
        report.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(f"{hidden} of {total} all-reduces ran and finished while backward still had work to do")
    sys.exit(0 if hidden else 1)


if __name__ == "__main__":
    main()
