"""Benchmark: 03's hand-written rings against dist.all_reduce, message size by message size.

`ring_*` keys time the fastest hand-written ring, pipelined_ring_all_reduce (1 MiB messages); `lesson_ring_*` keys
the lesson's ring_all_reduce (a whole chunk per step); `library_*` dist.all_reduce. All three run in one process
group, round by round, so one run compares them side by side.

algbw = bytes / time; busbw = algbw x 2(N-1)/N, the bytes each rank actually sends per byte reduced, as
nccl-tests define it (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md).

  torchrun --nproc_per_node=2 benchmarks/all_reduce.py --json allreduce.json --plot allreduce.png

They alternate after an untimed warm-up round and the order flips every round, so machine noise hits both
alike; each repetition counts as long as its slowest rank; the ratio is taken within each round, then the median
over rounds (a slow spell of the machine slows both sides of its round and cancels out). See benchmarks/README.md.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import check_writable, human, load_script, pyplot, quartiles, write_json  # noqa: E402

lesson = load_script("03_all_reduce.py")  # its setup block, and the ring under test


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # GPU collectives are asynchronous: wait before reading the clock


def measure(args, device, world):
    sizes = [s for s in (1024 * 4 ** k for k in range(12)) if args.min_bytes <= s <= args.max_bytes]
    impls = {"ring": lesson.pipelined_ring_all_reduce, "lesson_ring": lesson.ring_all_reduce,
             "library": dist.all_reduce}
    bus = 2 * (world - 1) / world  # bytes each rank must send per byte reduced (nccl-tests' busbw factor)
    rows = []
    for nbytes in sizes:
        x = torch.zeros(nbytes // 4, device=device)  # sums of zeros stay zero: no overflow over many calls
        # As nccl-tests do, time a run of back-to-back calls and divide: one call of a small message is shorter
        # than the clock's noise and the skew between ranks leaving the barrier.
        calls = max(1, min(20, (16 << 20) // nbytes))
        times = {name: [] for name in impls}
        for i in range(args.iters + 1):  # round 0 warms up (connections, buffers) and is not timed
            order = list(impls) if i % 2 else list(impls)[::-1]  # the order flips every round
            for name in order:
                sync(device)
                dist.barrier(device_ids=[device.index] if dist.get_backend() == "nccl" else None)
                t0 = time.perf_counter()
                for _ in range(calls):
                    impls[name](x)
                sync(device)
                if i:
                    times[name].append((time.perf_counter() - t0) / calls)
        # A collective is as slow as its slowest rank: take the max over ranks of each repetition.
        t = torch.tensor([times[name] for name in impls], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ts = dict(zip(impls, t.tolist()))
        row = {"bytes": nbytes}
        for name in impls:
            q1, med, q3 = quartiles(ts[name])
            row.update({f"{name}_ms": med * 1e3, f"{name}_ms_p25": q1 * 1e3, f"{name}_ms_p75": q3 * 1e3,
                        f"{name}_algbw_gbps": nbytes / med / 1e9, f"{name}_busbw_gbps": nbytes / med / 1e9 * bus})
        for name in ("ring", "lesson_ring"):
            q1, med, q3 = quartiles([lib / ours for ours, lib in zip(ts[name], ts["library"])])
            row.update({f"{name}_over_library_busbw": med, f"{name}_over_library_busbw_p25": q1,
                        f"{name}_over_library_busbw_p75": q3})
        rows.append(row)
    return rows


def spread(row, name):
    return f"{row[name + '_ms']:8.3f} ({row[name + '_ms_p25']:.3f}-{row[name + '_ms_p75']:.3f})"


def ratio(row, name):
    key = f"{name}_over_library_busbw"
    return f"{row[key]:5.2f} ({row[key + '_p25']:.2f}-{row[key + '_p75']:.2f})"


def report(args, rows, device, world):
    say = lesson.print0
    say(f"\nall-reduce float32, world_size={world}, backend={dist.get_backend()}, torch {torch.__version__}, "
        f"median of {args.iters} rounds (max over ranks); busbw = algbw * 2(N-1)/N; "
        f"x/library = median of the per-round busbw ratios; ring = pipelined_ring_all_reduce, lesson = ring_all_reduce")
    say("| size | ring ms (p25-p75) | lesson ms (p25-p75) | library ms (p25-p75) | ring busbw GB/s "
        "| library busbw GB/s | ring/library (p25-p75) | lesson/library (p25-p75) |")
    say("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        say(f"| {human(r['bytes']):>7} | {spread(r, 'ring')} | {spread(r, 'lesson_ring')} | {spread(r, 'library')} "
            f"| {r['ring_busbw_gbps']:7.3f} | {r['library_busbw_gbps']:7.3f} | {ratio(r, 'ring')} "
            f"| {ratio(r, 'lesson_ring')} |")
    if lesson.RANK != 0:
        return
    if args.json:
        write_json(args.json, {"world_size": world, "backend": dist.get_backend(), "device": device.type,
                               "torch": torch.__version__, "rows": rows})
        say(f"wrote {args.json}")
    if args.plot:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, label in (("ring", "pipelined_ring_all_reduce (ours)"), ("lesson_ring", "ring_all_reduce (ours)"),
                            ("library", "dist.all_reduce")):
            ax.plot([r["bytes"] for r in rows], [r[f"{name}_busbw_gbps"] for r in rows], marker="o", label=label)
        ax.set(xscale="log", xlabel="message size (bytes)", ylabel="busbw (GB/s)",
               title=f"all-reduce busbw, {world} ranks, {dist.get_backend()}")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        say(f"wrote {args.plot}")


def main(args):
    device = lesson.setup(args)
    world = dist.get_world_size()
    lesson.print0(f"world_size={world} backend={dist.get_backend()} device={device.type} torch={torch.__version__}")
    rows = measure(args, device, world)
    report(args, rows, device, world)
    lesson.print0(f"OK benchmark finished on {world} ranks")


def parse_args():
    p = lesson.Parser(__doc__)
    p.add_argument("--min-bytes", type=lesson.at_least(4), default=1 << 10, help="smallest message")
    p.add_argument("--max-bytes", type=lesson.at_least(4), default=64 << 20, help="largest message")
    p.add_argument("--iters", type=lesson.at_least(1), default=100, help="timed rounds per size and implementation")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.add_argument("--plot", default=None, help="write busbw vs message size to this PNG")
    a = p.parse_args()
    if a.max_bytes < a.min_bytes:
        p.error("need --min-bytes <= --max-bytes")
    for path, flag in ((a.json, "--json"), (a.plot, "--plot")):
        try:
            check_writable(path, flag)
        except OSError as e:
            p.error(str(e))
    return a


if __name__ == "__main__":
    lesson.run(main, parse_args)
