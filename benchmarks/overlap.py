"""When each all-reduce ran against backward: 05's GPT-2 trained a few steps under torch.profiler, then its trace read.

  torchrun --nproc_per_node=2 benchmarks/overlap.py [--impl manual|naive|torch] [--compile] [--model DIR] [--out traces]
  python benchmarks/overlap.py traces/trace_rank0.json [--json overlap.json]     (read any torch.profiler trace)

Under torchrun it imports 05's model, wrapper and loss (05_manual_ddp_gpt2.py), trains 5 steps on random tokens,
profiles steps 3-5 (one trace per rank in --out), and reads rank 0's. Given a trace, it only reads it.
For every profiled step: the span of backward (the autograd engine's first to last function), and each all-reduce
launched in the step, with when it was launched and when gloo worked on it, in ms from the step's start (gloo
traces only: an NCCL trace is refused, see report).
An all-reduce that finished before backward's last function began was hidden behind backward's compute: the point
of buckets and hooks. The last line counts them; exit status 1 if there were none (no overlap at all: one bucket, or a
whole-model torch.compile, which hands over every gradient only when its whole backward is done).
Reading needs no torch: the trace is JSON.
"""

import argparse
import json
import os
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


def profile(args):
    """Under torchrun: 05's model and --impl, 5 steps, steps 3-5 profiled; each rank writes its trace. Returns
    rank 0's trace, or None on the other ranks."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # keep the profiler's start/stop notes out of the output
    import torch
    import torch.distributed as dist
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import load_script
    lesson = load_script("05_manual_ddp_gpt2.py")
    argv = ["--impl", args.impl, "--device", args.device] + ["--compile"] * args.compile
    if args.model:
        argv += ["--model", args.model]
    largs = lesson.parse_args(argv)
    device = lesson.setup(largs)
    model = lesson.build_model(largs)[1].to(device)
    loss = lesson.cross_entropy
    if args.compile:
        lesson.compile_blocks(model)
        loss = torch.compile(loss)
    ddp = lesson.wrap(model, args.impl, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(lesson.RANK)  # each rank its own batches, as 05's sampler gives them
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"trace_rank{lesson.RANK}.json")
    schedule = torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1)
    with torch.profiler.profile(schedule=schedule, on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:
        for _ in range(5):
            batch = torch.randint(0, model.config.vocab_size, (largs.batch_size, largs.seq_len + 1), generator=g)
            lesson.next_token_loss(ddp, batch.to(device), largs, loss).backward()
            if args.impl == "naive":
                lesson.average_gradients(model, lesson.WORLD)
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step()
    dist.barrier()
    dist.destroy_process_group()
    return path if lesson.RANK == 0 else None


def report(path, json_path):
    try:
        with open(path) as f:
            trace = json.load(f)
        found = steps(trace)
    except (OSError, ValueError, KeyError, TypeError) as e:
        fail(f"{path}: not a readable profiler trace ({type(e).__name__}: {e})")
    if any("nccl" in str(e.get("name", "")).lower() for e in trace["traceEvents"]):
        # NCCL's CPU-side span ends when its kernel is queued, so every all-reduce would look hidden: the overlap
        # is on the GPU's timeline, between the NCCL kernels and backward's, which this reader does not pair up.
        fail(f"{path}: an NCCL trace; its CPU-side spans end at launch and cannot show overlap: open it in "
             "Perfetto and compare the ncclDevKernel rows with backward's kernels on the GPU's streams")
    if not found:
        fail(f"{path}: no profiled step with a backward in it")
    hidden = total = 0
    rows = []
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
        rows.append(row)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"{hidden} of {total} all-reduces ran and finished while backward still had work to do")
    sys.exit(0 if hidden else 1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", nargs="?", help="a chrome trace JSON from torch.profiler: read it, profile nothing")
    p.add_argument("--impl", choices=["manual", "naive", "torch"], default="manual", help="05's --impl to profile")
    p.add_argument("--compile", action="store_true", help="05's --compile: each block, the head and the loss compiled")
    p.add_argument("--model", default=None, help="05's --model (a Hugging Face name or local dir); default: 05's")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="05's --device")
    p.add_argument("--out", default="traces", help="where each rank writes its trace")
    p.add_argument("--json", default=None, help="also write the numbers here")
    args = p.parse_args()
    path = args.trace or profile(args)
    if path:
        report(path, args.json)


if __name__ == "__main__":
    main()
