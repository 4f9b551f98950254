"""Fitting benchmarks/costmodel.py to measurements, and checking it against them.

Two kinds of fit live here. The first fits the lessons' own collectives on this machine, under torchrun (`fit`),
and checks the model against what the same run measures (`check`). The second fits your own GPU runs (`forecast`).
From a step measured on one node it takes the compute's rate, and from two nodes the network's bandwidth. An
all-reduce sweep across two nodes gives the network's latency too. A step on a third node count, or a sweep on more
nodes, gives how the bandwidth a node gets falls past two nodes. Then it forecasts more nodes, and says which
numbers were measured, which fitted and which assumed.

  torchrun --nproc_per_node=2 benchmarks/costmodel.py fit --out calibration.json
  torchrun --nproc_per_node=2 benchmarks/costmodel.py check --json check.json
  python benchmarks/costmodel.py forecast --model gpt2-xl --hardware 100gbe --step-ms 1:120 2:810
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import costmodel  # noqa: E402
from costmodel import GB, MIB, Hardware, Link, Run, ddp_step, memory, predict  # noqa: E402

from common import load_script, write_json  # noqa: E402

FP32 = dict(param_bytes=4, grad_bytes=4, state_bytes=8)  # the lessons' fp32 AdamW: 4 + 4 + 8 bytes a parameter
_lesson = []  # 03_all_reduce.py, loaded once under torchrun: its setup block and rings


def lesson_module():
    """03's module, one copy for all: its run() must catch the UsageError its setup() raises."""
    if not _lesson:
        _lesson.append(load_script("03_all_reduce.py"))
    return _lesson[0]


# --- fitting and checking on the machine at hand (under torchrun) ---
def line_fit(sizes, times):
    """(alpha, beta) of t = alpha + n beta by least squares, each point weighted by 1/t^2 (relative errors), so
    that small messages count as much as large ones; neither below zero."""
    w = [1 / max(t, 1e-9) ** 2 for t in times]
    sw, sx, sy = sum(w), sum(wi * n for wi, n in zip(w, sizes)), sum(wi * t for wi, t in zip(w, times))
    sxx, sxy = sum(wi * n * n for wi, n in zip(w, sizes)), sum(wi * n * t for wi, n, t in zip(w, sizes, times))
    beta = max(1e-15, (sw * sxy - sx * sy) / (sw * sxx - sx * sx))
    return max(0.0, (sy - beta * sx) / sw), beta


FIT_SIZES = (1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 4 << 20, 64 << 20)  # `check` predicts between


def fit_link(lesson, device, world, iters=8, rows=None):
    """alpha and beta of one ring step from all_reduce.py's own measurement of 03's pipelined ring at FIT_SIZES
    (least squares on t - additions = 2(N-1) alpha + 2(N-1) c beta; the lesson ring allocates its receive
    buffer each call, and page faults make its largest sizes slower per byte), gamma from timing the ring's
    addition of a 1 MiB piece, point-to-point from send_recv.py's ping-pong (ranks 0 and 1). rows:
    all_reduce.py's rows at FIT_SIZES, if measured already. The same numbers on every rank (rank 0's, broadcast)."""
    import torch
    import torch.distributed as dist
    a, b = torch.ones(lesson.PIECE_BYTES // 4), torch.ones(lesson.PIECE_BYTES // 4)
    adds = []
    for _ in range(30):
        t0 = time.perf_counter()
        a.add_(b)
        adds.append(time.perf_counter() - t0)
    gamma = statistics.median(adds) / a.nbytes
    rows = [r for r in rows or measure_rings(lesson, device, FIT_SIZES, iters) if r["bytes"] in FIT_SIZES]
    steps = 2 * (world - 1)
    adds = [Link(0.0, 0.0, gamma, lesson.PIECE_BYTES).all_reduce(r["bytes"], world) for r in rows]  # gamma's part
    alpha, beta = line_fit([steps * r["bytes"] / world for r in rows],
                           [max(1e-9, r["ring_ms"] / 1e3 - add) for r, add in zip(rows, adds)])
    send_recv = load_script("benchmarks/send_recv.py")
    p2p = send_recv.ping_pong(device, [4 ** k for k in range(2, 12)], iters) if lesson.RANK < 2 else []
    p2p_alpha, p2p_beta = line_fit([r["bytes"] for r in p2p], [r["latency_us"] * 1e-6 for r in p2p]) if p2p \
        else (0.0, 0.0)
    fitted = torch.tensor([alpha / steps, beta, gamma, p2p_alpha, p2p_beta], dtype=torch.float64)
    dist.broadcast(fitted, src=0)
    alpha, beta, gamma, p2p_alpha, p2p_beta = fitted.tolist()
    # On a CPU, gloo's threads move and add the bytes: they overlap backward only if a core is left for them
    spare = device.type != "cpu" or (os.cpu_count() or 1) >= 2 * int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return dict(alpha_s=alpha, beta_s_per_byte=beta, gamma_s_per_byte=gamma, p2p_alpha_s=p2p_alpha,
                p2p_beta_s_per_byte=p2p_beta, piece_bytes=lesson.PIECE_BYTES, overlaps=spare, fitted_on_ranks=world,
                ring_rows=[dict(bytes=r["bytes"], ms=r["ring_ms"]) for r in rows],
                p2p_rows=p2p if lesson.RANK == 0 else None)


def measure_rings(lesson, device, sizes, iters):
    """all_reduce.py's own measurement: the pipelined ring, the lesson ring and gloo's, side by side, at
    all_reduce.py's sizes (1 KiB times powers of 4) from the smallest to the largest of sizes, kept if in sizes."""
    all_reduce = load_script("benchmarks/all_reduce.py")
    all_reduce.lesson = lesson
    rows = all_reduce.measure(argparse.Namespace(min_bytes=min(sizes), max_bytes=max(sizes), iters=iters),
                              device, lesson.WORLD)
    return [r for r in rows if r["bytes"] in sizes]


def check_ddp(lesson, device, link, caps_mb, rounds, shape):
    """DDPCore's step (05) at each bucket cap against the prediction from the same run's backward, measured on a
    bare model (no DDP) with a hook per gradient. Rounds alternate the bare step and each cap (a slow spell of
    the machine hits all alike); a step counts as long as its slowest rank; medians over rounds."""
    import torch
    import torch.distributed as dist
    m05 = load_script("05_manual_ddp_gpt2.py")
    from transformers import GPT2Config, GPT2LMHeadModel

    def build():  # a GPT-2 of --shape's layers and width, the same weights on every rank (05's model, resized)
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=shape[1], n_layer=shape[0], n_head=4,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                          activation_function="gelu_pytorch_tanh"))
    bare = build()
    wrapped = {}
    for cap in caps_mb:
        model = build()
        wrapped[cap] = m05.DDPCore(model, bucket_cap_mb=cap)
    params = [p for p in bare.parameters() if p.requires_grad]
    stamp = {}
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: stamp.__setitem__(i, time.perf_counter()))
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in [("bare", bare), *wrapped.items()]}
    g = torch.Generator().manual_seed(lesson.RANK)
    x = torch.randint(0, 256, (shape[2], 65), generator=g)

    def step(model, opt, profile=None):
        dist.barrier()
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(input_ids=x[:, :-1], use_cache=False).logits.flatten(0, 1),
                                                 x[:, 1:].flatten())
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=False)
        t3 = time.perf_counter()
        if profile is not None:
            profile.append((t1 - t0, t2 - t1, t3 - t2, [stamp[i] - t1 for i in range(len(params))]))
        return t3 - t0

    profiles, times = [], {cap: [] for cap in caps_mb}
    for r in range(rounds + 2):  # two warm-up rounds: DDPCore rebuilds its buckets after the first backward
        keys = ["bare", *caps_mb] if r % 2 else [*caps_mb, "bare"][::-1]
        for k in keys:
            if k == "bare":
                step(bare, opts[k], profiles if r >= 2 else None)
            else:
                t = step(wrapped[k], opts[k])
                if r >= 2:
                    times[k].append(t)
    # The slowest rank per round, for the measured steps and the bare profile alike
    t = torch.tensor([times[c] for c in caps_mb] + [[p[0] + p[1] + p[2] for p in profiles]], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    measured = {c: statistics.median(t[j].tolist()) for j, c in enumerate(caps_mb)}
    bare_ms = statistics.median(t[-1].tolist())
    # The median bare step, per part; the gradients' ready times of the median-backward round
    prof = sorted(profiles, key=lambda p: p[1])[len(profiles) // 2]
    fwd, bwd, opt = (statistics.median(p[j] for p in profiles) for j in range(3))
    order = sorted(range(len(params)), key=lambda i: prof[3][i])
    ready = [prof[3][i] * bwd / prof[1] for i in order]
    grad_bytes = [params[i].numel() * params[i].element_size() for i in order]
    rows = []
    for cap in caps_mb:
        pred, exposed = ddp_step(fwd, ready, bwd, opt, grad_bytes, cap * MIB, link, lesson.WORLD)
        n_buckets = len(wrapped[cap].buckets)
        rows.append(dict(bucket_cap_mb=cap, buckets=n_buckets, predicted_ms=pred * 1e3,
                         measured_ms=measured[cap] * 1e3, error=pred / measured[cap] - 1,
                         exposed_comm_ms=exposed * 1e3, bare_ms=bare_ms * 1e3))
    return rows, sum(grad_bytes)


def check_memory(lesson, device):
    """Bytes each rank holds at the optimizer step (parameters, gradients, AdamW's state), as 07 and 08 count
    them, against memory() in fp32 (4 + 4 + 8 bytes a parameter)."""
    import torch
    import torch.nn as nn
    m07, m08 = load_script("07_zero.py"), load_script("08_fsdp.py")
    a07 = m07.parse_args(["--steps", "1", "--n-layer", "2", "--n-embd", "128", "--vocab-size", "512",
                          "--seq-len", "32", "--batch-size", "2", "--bucket-cap-mb", "0.25"])
    base = m07.build_model(a07, device)
    n = sum(p.numel() for p in base.parameters())
    rows = []
    for kind, name in ((0, "ddp"), (1, "zero1"), (2, "zero2")):
        held = m07.train(kind, base, a07, device)["held"]
        pred = memory(name, n, lesson.WORLD, **FP32)
        rows.append((name, held, [pred["parameters"], pred["gradients"], pred["optimizer_state"]]))
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    n = sum(p.numel() for p in net.parameters())
    for layer in net:
        m08.fully_shard(layer)
    m08.fully_shard(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net(torch.randn(8, 256)).square().mean().backward()
    opt.step()
    held = [mib * MIB for mib in m08.held_mib(list(net.parameters()), opt)]
    pred = memory("fsdp", n, lesson.WORLD, **FP32)
    rows.append(("fsdp", held, [pred["parameters"], pred["gradients"], pred["optimizer_state"]]))
    # PyTorch's DDP: the bytes its gradients and buckets hold after six steps (the buckets rebuilt after the
    # first), with and without gradient_as_bucket_view, against memory()'s gradients and bucket copy. No broadcast
    # at construction (init_sync=False; the replicas are seeded alike): it flattens the parameters into one copy,
    # and when gloo's thread drops that copy last, the free is missing from the profiler's records, so the copy
    # counted as held (1 run in 7: one gradient-sized buffer more, 3x not 2x, 2x not 1x).
    for view in (False, True):
        torch.manual_seed(0)
        net = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
        n = sum(p.numel() for p in net.parameters())

        def six_steps():
            ddp = nn.parallel.DistributedDataParallel(net, gradient_as_bucket_view=view, bucket_cap_mb=0.25,  # noqa: B023
                                                      init_sync=False)
            for _ in range(6):
                ddp(torch.randn(8, 256)).square().mean().backward()
            return ddp
        pred = memory("ddp", n, lesson.WORLD, **FP32, ddp_buckets=not view)
        rows.append((f"torch ddp{', bucket view' if view else ''}", [held_bytes(six_steps)],
                     [pred["gradients"], pred["buckets_and_units"]]))
    return [dict(strategy=s, measured_bytes=sum(h), predicted_bytes=sum(p), error=sum(p) / sum(h) - 1,
                 measured_parts=h, predicted_parts=p) for s, h, p in rows]


def held_bytes(fn):
    """Bytes that fn() leaves allocated (allocations minus frees while it runs, what it returns kept alive), from
    the profiler's allocation records: on CPU the resident set is too coarse (benchmarks/ddp_step.py's peak_mb
    reads the same records; private profiler internals: fine in a benchmark, never in a lesson)."""
    import torch
    from torch._C._profiler import _EventType
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        kept = fn()  # noqa: F841 (alive until the records are read)
    total, todo = 0, list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        node = todo.pop()
        todo += node.children
        if node.tag == _EventType.Allocation:  # alloc_size > 0 for an allocation, < 0 for a free
            total += node.extra_fields.alloc_size
    return total


# --- fit and check: the command line ---
def describe(cal):
    return (f"fitted on {cal['fitted_on_ranks']} ranks: a ring step alpha {cal['alpha_s'] * 1e6:.1f} us + bytes / "
            f"{1 / cal['beta_s_per_byte'] / GB:.2f} GB/s, addition {1 / cal['gamma_s_per_byte'] / GB:.2f} GB/s; "
            f"one message alone {cal['p2p_alpha_s'] * 1e6:.1f} us + bytes / {1 / cal['p2p_beta_s_per_byte'] / GB:.2f} "
            f"GB/s; overlap with compute: {'yes' if cal['overlaps'] else 'no (no core to spare)'}")


def fit_main(args):
    lesson = lesson_module()
    if lesson.WORLD < 2:
        raise lesson.UsageError("fit needs 2+ ranks: torchrun --nproc_per_node=2 benchmarks/costmodel.py fit --out F")
    device = lesson.setup(args)
    cal = fit_link(lesson, device, lesson.WORLD, args.iters)
    lesson.print0(describe(cal))
    if lesson.RANK == 0:
        write_json(args.out, cal)
        lesson.print0(f"wrote {args.out}")
    lesson.print0("OK fitted")


def check_main(args):
    """Fit, then measure in the same run: the rings over sizes, DDPCore's step at two bucket caps, the memory."""
    lesson = lesson_module()
    if lesson.WORLD < 2:
        raise lesson.UsageError("check needs 2+ ranks: torchrun --nproc_per_node=2 benchmarks/costmodel.py check")
    device = lesson.setup(args)
    say, world = lesson.print0, lesson.WORLD
    t0 = time.perf_counter()
    # Measure --blocks times and take the medians: a machine whose load changes by the minute (other jobs on its
    # cores) then weighs on the fitted sizes and the checked ones alike.
    blocks = []
    for _ in range(args.blocks):  # one measurement gives the fit (FIT_SIZES) and the sizes checked
        blocks.append(measure_rings(lesson, device, sorted({*FIT_SIZES, *map(int, args.sizes)}), args.iters))
    # the median over blocks of each size's median, for the fit and the check alike
    rows = [dict(bytes=r["bytes"], **{k: statistics.median(b[j][k] for b in blocks) for k in ("ring_ms",
                                                                                           "lesson_ring_ms")})
            for j, r in enumerate(blocks[0])]
    cal = fit_link(lesson, device, world, args.iters, rows)
    link = Link.from_calibration(cal)
    say(f"{describe(cal)}, from {args.blocks} blocks ({time.perf_counter() - t0:.0f} s)")
    measured = [r for r in rows if r["bytes"] in args.sizes]
    ring_rows = []
    for r in measured:
        for name, f in (("ring", link.all_reduce), ("lesson_ring", link.lesson_ring)):
            pred, ms = f(r["bytes"], world) * 1e3, r[f"{name}_ms"]
            ring_rows.append(dict(impl=name, bytes=r["bytes"], predicted_ms=pred, measured_ms=ms, error=pred / ms - 1))
    say("\n| ring | bytes | predicted ms | measured ms (median) | error |\n|---|---:|---:|---:|---:|")
    for r in ring_rows:
        say(f"| {r['impl']} | {r['bytes']:,} | {r['predicted_ms']:.3f} | {r['measured_ms']:.3f} | {r['error']:+.0%} |")
    ddp_rows, total = check_ddp(lesson, device, link, args.caps, args.rounds, args.shape)
    say(f"\nDDPCore (05), {total / MIB:.2f} MiB of gradients, median of {args.rounds} rounds:\n"
        "| bucket cap MiB | buckets | predicted ms | measured ms | error | exposed comm ms (model) | bare step ms |\n"
        "|---:|---:|---:|---:|---:|---:|---:|")
    for r in ddp_rows:
        say(f"| {r['bucket_cap_mb']} | {r['buckets']} | {r['predicted_ms']:.1f} | {r['measured_ms']:.1f} | "
            f"{r['error']:+.0%} | {r['exposed_comm_ms']:.1f} | {r['bare_ms']:.1f} |")
    mem_rows = check_memory(lesson, device)
    say("\nheld at the optimizer step (parameters + gradients + AdamW state; PyTorch's DDP: its gradients and "
        "buckets), fp32:\n| strategy | predicted bytes | measured bytes (07/08; allocated) | error |\n"
        "|---|---:|---:|---:|")
    for r in mem_rows:
        say(f"| {r['strategy']} | {r['predicted_bytes']:,} | {r['measured_bytes']:,} | {r['error']:+.1%} |")
    if lesson.RANK == 0 and args.json:
        write_json(args.json, dict(world_size=world, calibration=cal, rings=ring_rows, ddp=ddp_rows,
                                   memory=mem_rows, seconds=time.perf_counter() - t0))
        say(f"wrote {args.json}")
    say(f"OK checked on {world} ranks in {time.perf_counter() - t0:.0f} s")




# --- forecast: fit your own runs, then forecast more nodes ---
@dataclass(frozen=True)
class Step:
    """A step time measured on `nodes` whole nodes, at `batch` sequences a GPU."""
    nodes: int
    ms: float
    batch: int


def parse_step(text: str, batch: int) -> Step:
    """--step-ms's NODES:MS[:BATCH]: 2:810 is two nodes at 810 ms a step; the batch defaults to --batch-size."""
    parts = text.split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        step = Step(int(parts[0]), float(parts[1]), int(parts[2]) if len(parts) == 3 else batch)
    except ValueError:
        raise ValueError(f"{text!r}: not NODES:MS or NODES:MS:BATCH (1:120 is one node at 120 ms)") from None
    if step.nodes < 1 or step.batch < 1 or not (step.ms > 0 and math.isfinite(step.ms)):
        raise ValueError(f"{text!r}: the nodes, the milliseconds and the batch must all be above 0")
    return step


def read_sweep(path: str, per_node: int) -> tuple[list[int], list[float], int]:
    """(bytes, seconds, ranks) of NCCL's all-reduce in a benchmarks/all_reduce.py --json run across nodes."""
    try:
        with open(path) as f:
            data = json.load(f)
        rows, world = data["rows"], int(data["world_size"])
        sizes, seconds = [int(r["bytes"]) for r in rows], [r["library_ms"] / 1e3 for r in rows]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--sweep {path}: not the JSON of benchmarks/all_reduce.py --json ({e})") from None
    if data.get("device") != "cuda":
        raise ValueError(f"--sweep {path}: measured on {data.get('device')}, not on GPUs")
    if world <= per_node:
        raise ValueError(f"--sweep {path}: {world} ranks fit in one node of {per_node}; run it across two nodes")
    return sizes, seconds, world


def fit_sweep(sizes: list[int], seconds: list[float], ranks: int, hw: Hardware) -> tuple[float, float | None]:
    """(GB/s a node, seconds a hop or None) between nodes, from NCCL's all-reduce times at several sizes. A line
    t = a + n s through them (relative errors): the ring moves 2(N-1)/N of the bytes through each node's NICs, so
    the bandwidth is 2(N-1)/N / s. The intercept a is NCCL's ring latency (nccl_ring_latency), which gives the hop
    across nodes; None when the intercept is below what NCCL's model counts inside the nodes alone."""
    a, s = line_fit(sizes, seconds)
    busbw = 2 * (ranks - 1) / ranks / s / GB
    nodes = math.ceil(ranks / hw.gpus_per_node)
    steps, inter = 2 * (ranks - 1), min(2 * (ranks - 1), 2 * nodes)
    inside = costmodel.NCCL_RING_BASE + (steps - inter) * max(hw.alpha_intra, costmodel.NCCL_NET_OVERHEAD)
    hop = (a / hw.ring_plateau - inside) / inter
    return busbw, hop if hop > 0 else None


def fit_compute(run: Run, hw: Hardware, steps: list[Step]) -> tuple[float, float]:
    """(HFU, fixed ms a micro-batch) from steps measured on one node. One batch size gives the rate alone, at the
    run's fixed cost. Two or more give both, by least squares of step = fixed + FLOPs / rate + the rest (the
    optimizer, the communication the model sees), refined as the rest moves with the rate."""
    g = hw.gpus_per_node
    seq, accum = run.seq_len, run.grad_accum
    params = run.model.layers * costmodel.layer_params(run.model)[0] + costmodel.layer_params(run.model)[1]
    _, hw_flops = costmodel.flops_per_token(run.model, params, seq, run.activation_checkpointing, run.attention)

    def at(step, hfu, fixed):
        return dataclasses.replace(run, gpus=g, batch=step.batch, mfu=None, hfu=hfu, fixed_ms=fixed)

    def per_gpu(step):
        return step.batch * seq * accum / (step.ms / 1e3)

    largest = max(steps, key=lambda s: s.batch)
    hfu = costmodel.solve_hfu(at(largest, None, run.fixed_ms), hw, per_gpu(largest))
    if len({s.batch for s in steps}) < 2:
        return hfu, run.fixed_ms
    fixed = run.fixed_ms
    for _ in range(20):
        xs = [accum * s.batch * seq * hw_flops / (hw.peak_tflops * 1e12) * 1e3 for s in steps]  # ms at 100% of peak
        rest = [predict(at(s, hfu, fixed), hw)["step_ms"] - accum * fixed - x / hfu for s, x in zip(steps, xs)]
        ys = [s.ms - r for s, r in zip(steps, rest)]
        n, sx, sy = len(xs), sum(xs), sum(ys)
        sxx, sxy = sum(x * x for x in xs), sum(x * y for x, y in zip(xs, ys))
        slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
        intercept = (sy - slope * sx) / n
        if intercept < 0:  # no fixed cost can be negative: the line through the origin
            intercept, slope = 0.0, sxy / sxx
        if slope < 1:  # faster than the peak: the rate at the peak, the rest a fixed cost
            slope, intercept = 1.0, max(0.0, (sy - sx) / n)
        hfu, fixed = 1 / slope, intercept / accum
    return hfu, fixed


def fit_network(run: Run, hw: Hardware, step: Step) -> tuple[float | None, float]:
    """(GB/s a node between nodes or None, the step the model gives at the line rate): the bandwidth at which the
    model gives the measured multi-node step, by bisection in log space (the step only shortens as it rises). None
    when the line rate already gives a step as long as the one measured, or longer: the run hid its communication."""
    line = hw.inter_line or hw.inter_busbw

    def step_ms(busbw):
        wide = dataclasses.replace(run, gpus=step.nodes * hw.gpus_per_node, batch=step.batch)
        return predict(wide, dataclasses.replace(hw, inter_busbw=busbw))["step_ms"]
    at_line = step_ms(line)
    if at_line >= step.ms:
        return None, at_line
    lo, hi = math.log(1e-4), math.log(line)
    if step_ms(math.exp(lo)) < step.ms:
        return math.exp(lo), at_line
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step_ms(math.exp(mid)) > step.ms else (lo, mid)
    return math.exp(hi), at_line


MOST_FALLOFF = 3.0  # (2 / nodes) ** 3: a fabric that gives 16 nodes 0.2% of what it gives 2


def share_and_falloff(b2: float, bn: float, nodes: int, falloff: float) -> tuple[float, float]:
    """(the fabric's share a node on two nodes, falloff) that give bn GB/s a node on this many nodes, where two
    nodes gave b2. The falloff stays as assumed if it can, and the share moves: a third point cannot give both, and
    the exponent is what the published runs fitted. Only a fall steeper than it, from b2 itself, changes it."""
    if bn >= b2:
        return b2, 0.0
    if bn >= b2 * (2 / nodes) ** falloff:
        return bn * (nodes / 2) ** falloff, falloff
    return b2, min(MOST_FALLOFF, math.log(b2 / bn) / math.log(nodes / 2))


def fit_falloff(run: Run, hw: Hardware, step: Step) -> tuple[float, float]:
    """(the fabric's share a node on two nodes, falloff) that give a step measured on more than two nodes: the
    bandwidth a node gets there, by bisection (the step only shortens as it rises), then share_and_falloff. No
    falloff when even the bandwidth of two nodes gives a step as long as the one measured."""
    def step_ms(busbw):
        wide = dataclasses.replace(run, gpus=step.nodes * hw.gpus_per_node, batch=step.batch)
        return predict(wide, dataclasses.replace(hw, inter_busbw=busbw, falloff=0.0))["step_ms"]
    if step_ms(hw.inter_busbw) >= step.ms:
        return hw.inter_busbw, 0.0
    lo, hi = math.log(1e-4), math.log(hw.inter_busbw)
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step_ms(math.exp(mid)) > step.ms else (lo, mid)
    return share_and_falloff(hw.inter_busbw, math.exp(hi), step.nodes, hw.falloff)


def peak_busbw(sizes: list[int], seconds: list[float], ranks: int) -> float:
    """The highest bus bandwidth of a sweep, GB/s: 2(N-1)/N x bytes / seconds, as nccl-tests reports it."""
    return max(2 * (ranks - 1) / ranks * n / t for n, t in zip(sizes, seconds)) / GB


def sweep_falloff(narrow: tuple, wide: tuple, hw: Hardware) -> tuple[float, float]:
    """(the fabric's share a node on two nodes, falloff) that two sweeps on different node counts imply, from each
    one's highest bus bandwidth. Peaks, not a line through every size: DDP's buckets move at the large messages'
    rate, and TCP's mid-size stalls would bend a line."""
    return share_and_falloff(peak_busbw(*narrow), peak_busbw(*wide), math.ceil(wide[2] / hw.gpus_per_node),
                             hw.falloff)


def forecast(run: Run, hw: Hardware, steps: list[Step], sweep: tuple | list | None = None,
             nodes: tuple[int, ...] = (1, 2, 4, 8, 16)) -> dict:
    """Fit the run to its measured steps (and all-reduce sweeps across nodes), then predict each node count.
    sweep: one sweep (bytes, seconds, ranks), or a list of them on different node counts. Returns the rows, the
    fitted figures, and three lists of plain sentences: what was measured, fitted, assumed."""
    g = hw.gpus_per_node
    line_rate = hw.inter_line or hw.inter_busbw
    hw = dataclasses.replace(hw, inter_line=line_rate)  # the fabric's share is counted from the line rate
    sweeps = sorted([sweep] if isinstance(sweep, tuple) else sweep or [], key=lambda w: w[2])
    if run.strategy in ("ddp", "zero1", "zero2") and run.bucket_mb is None:
        run = dataclasses.replace(run, bucket_mb=25.0)  # PyTorch's default, what the measured run most likely used
    one = [s for s in steps if s.nodes == 1]
    wide = sorted((s for s in steps if s.nodes > 1), key=lambda s: s.nodes)
    measured = [f"{'one node' if s.nodes == 1 else f'{s.nodes} nodes'}, {s.ms:g} ms a step at batch {s.batch}"
                for s in steps]
    fitted, assumed = [], []
    hfu, fixed = fit_compute(run, hw, one)
    run = dataclasses.replace(run, mfu=None, hfu=hfu, fixed_ms=fixed)
    if len({s.batch for s in one}) > 1:
        fitted.append(f"the compute at HFU {hfu:.3f} and a fixed {fixed:.1f} ms a micro-batch, from one node's steps")
    else:
        fitted.append(f"the compute at HFU {hfu:.3f}, from one node's step")
        cost = f"a fixed cost of {fixed:g} ms" if fixed else "no fixed cost"
        assumed.append(f"{cost} a micro-batch. Measure one node at two batch sizes to fit it")
    falloff_from = None  # what the falloff was fitted from, if anything
    if sweeps:
        busbw, hop = fit_sweep(*sweeps[0], hw)
        for w in sweeps:
            measured.append(f"NCCL's all-reduce on {w[2]} ranks across nodes, {len(w[0])} sizes")
        hw = hw.with_figures(mark="fitted", inter_busbw=busbw, alpha_inter=hop)
        fitted.append(f"{busbw:.3g} GB/s a node between nodes from the sweep ({busbw / line_rate:.0%} of the "
                      f"{line_rate:g} GB/s line rate)")
        if hop is None:
            assumed.append(f"{hw.alpha_inter * 1e6:g} us a hop between nodes. The sweep's latency is below what "
                           "NCCL's model counts inside the nodes")
        else:
            fitted.append(f"{hop * 1e6:.1f} us a hop between nodes, from the sweep")
        if len(sweeps) > 1 and math.ceil(sweeps[-1][2] / g) > max(2, math.ceil(sweeps[0][2] / g)):
            share, k = sweep_falloff(sweeps[0], sweeps[-1], hw)
            hw = hw.with_figures(mark="fitted", inter_line=share, falloff=k)
            falloff_from = f"{math.ceil(sweeps[-1][2] / g)}-node sweep"
    else:
        whose = "NCCL's own figure for InfiniBand" if hw.alpha_inter == 14e-6 else \
            "the profile's figure (NCCL's model says 14 on InfiniBand)"
        assumed.append(f"{hw.alpha_inter * 1e6:g} us a hop between nodes, {whose}. A sweep across two nodes "
                       "(--sweep) measures it")
    if wide:
        third = wide[-1] if wide[-1].nodes > max(2, wide[0].nodes) else None
        for _ in range(3 if third and wide[0].nodes > 2 else 1):  # the two figures meet when neither is on 2 nodes
            busbw, at_line = fit_network(run, hw, wide[0])
            if busbw is not None:
                hw = hw.with_figures(mark="fitted", inter_busbw=busbw)
            if third:
                share, k = fit_falloff(run, hw, third)
                hw = hw.with_figures(mark="fitted", inter_line=share, falloff=k)
                falloff_from = f"{third.nodes}-node step"
        if busbw is None:
            assumed.append(f"{hw.inter_busbw:g} GB/s a node between nodes. The {wide[0].nodes}-node step hid its "
                           f"communication, since the model gives {at_line:.1f} ms even at that rate")
        else:
            fitted.append(f"{busbw:.3g} GB/s a node between nodes, from the {wide[0].nodes}-node step "
                          f"({busbw / line_rate:.0%} of the {line_rate:g} GB/s line rate)")
    elif not sweeps:
        assumed.append(f"{line_rate:g} GB/s a node between nodes. That is the line rate, not a measurement. Real "
                       "runs often get a fraction of it (47% in one published run, docs/costmodel.md). Measure two "
                       "nodes (--step-ms 2:MS) or sweep all_reduce.py across them (--sweep)")
    share = f"{hw.inter_line:.3g} x (2 / nodes) ** {hw.falloff:.2f} GB/s"
    if falloff_from:
        fitted.append(f"past 2 nodes a node gets at most {share}, from the {falloff_from}" if hw.falloff else
                      f"no fall in the bandwidth a node gets past 2 nodes, from the {falloff_from}")
    elif hw.falloff:
        assumed.append(f"past 2 nodes a node gets at most {share}. An Ethernet fabric's all-reduce fell that way "
                       "from 2 to 6 nodes (NVIDIA/nccl-tests issue 169). A step on a third node count "
                       "(--step-ms 4:MS) fits it")
    else:
        assumed.append("past 2 nodes a node keeps the bandwidth it had on 2, as on the fast fabrics in "
                       "docs/costmodel.md. A step on a third node count (--step-ms 4:MS) fits how it falls")
    assumed.append("NCCL's ring or tree, as its tuning model picks")
    if run.bucket_mb:
        assumed.append(f"buckets of {run.bucket_mb:g} MiB" + (" (PyTorch's default)" if run.bucket_mb == 25 else ""))
    rows, checks = [], []
    for n in sorted(set(nodes) | {s.nodes for s in steps}):
        out = predict(dataclasses.replace(run, gpus=n * g), hw)
        mine = [s for s in steps if s.nodes == n and s.batch == run.batch]
        rows.append(dict(nodes=n, gpus=n * g, step_ms=out["step_ms"], tokens_per_s_per_gpu=out["tokens_per_s_per_gpu"],
                         exposed_comm_ms=out["exposed_comm_ms"], memory_gib_per_gpu=out["memory_gib_per_gpu"],
                         fits=out["fits"], measured_ms=mine[0].ms if mine else None, warnings=out["warnings"]))
    for s in steps:
        model = predict(dataclasses.replace(run, gpus=s.nodes * g, batch=s.batch), hw)["step_ms"]
        checks.append(dict(nodes=s.nodes, batch=s.batch, measured_ms=s.ms, model_ms=model, error=model / s.ms - 1))
    base = rows[0]["tokens_per_s_per_gpu"] if rows[0]["nodes"] == 1 else None
    for r in rows:
        r["vs_one_node"] = r["tokens_per_s_per_gpu"] / base if base else None
    return dict(rows=rows, checks=checks, hfu=hfu, fixed_ms=fixed, inter_busbw=hw.inter_busbw,
                alpha_inter=hw.alpha_inter, falloff=hw.falloff, inter_line=line_rate,
                hardware=costmodel.hardware_json(hw), measured=measured, fitted=fitted, assumed=assumed)


def forecast_main(args):
    try:
        run, hw = costmodel.run_from_args(args, gpus=1)
        sweeps = [read_sweep(path, hw.gpus_per_node) for path in args.sweep]
        out = forecast(run, hw, args.steps, sweeps, tuple(args.nodes))
    except ValueError as e:
        sys.exit(print(f"error: {e}", file=sys.stderr) or 2)
    for line in dict.fromkeys(w for r in out["rows"] for w in r["warnings"]):
        print(f"warning: {line}", file=sys.stderr)
    if args.json:
        print(json.dumps(out))
        return
    layer, outer = costmodel.layer_params(run.model)
    print(f"{run.model.name} ({(run.model.layers * layer + outer) / 1e9:.2f}B parameters), {run.strategy}, "
          f"{hw.gpus_per_node} GPU{'s' * (hw.gpus_per_node > 1)} a node, {run.batch} x {run.seq_len} tokens a "
          f"micro-batch, {run.grad_accum} micro-batch{'es' * (run.grad_accum > 1)} a step")
    for kind in ("measured", "fitted", "assumed"):
        for line in out[kind]:
            print(f"  {kind:<9} {line}")
    print("  the model against each step measured: " + ", ".join(
        f"{c['nodes']} node{'s' * (c['nodes'] > 1)} at batch {c['batch']} {c['model_ms']:.1f} ms ({c['error']:+.0%})"
        for c in out["checks"]))
    print("| nodes | GPUs | step ms | measured ms | tokens/s a GPU | vs one node | not hidden ms | memory GiB |\n"
          "|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in out["rows"]:
        seen = f"{r['measured_ms']:.1f}" if r["measured_ms"] else "forecast"
        ratio = f"{r['vs_one_node']:.2f}" if r["vs_one_node"] else ""
        print(f"| {r['nodes']} | {r['gpus']} | {r['step_ms']:.1f} | {seen} | {r['tokens_per_s_per_gpu']:,.0f} | "
              f"{ratio} | {r['exposed_comm_ms']:.1f} | {r['memory_gib_per_gpu']:.1f}"
              f"{'' if r['fits'] else ', does NOT fit'} |")
