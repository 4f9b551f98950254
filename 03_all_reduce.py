"""03 - All-reduce: every rank ends with the sum of everyone's tensor. DDP is this, applied to gradients.

What it teaches, in order:
  1. the reduce ops (SUM, PRODUCT, MIN, MAX, and BOR where the backend has it) checked against closed forms;
  2. ring_all_reduce(): the bandwidth-optimal ring by hand. A reduce-scatter (N-1 steps: each rank ends
     owning the full sum of one chunk) then an all-gather (N-1 steps: the owned chunks go round). Each rank
     sends 2(N-1)/N of the data whatever N is, which is why rings scale. Checked against dist.all_reduce;
  3. gradient averaging with it: SUM then divide by N equals one process on the whole batch;
  4. --benchmark: time, algbw and busbw per message size, ring vs dist.all_reduce.

Run it (any N >= 2):
  CPU:        torchrun --nproc_per_node=2 03_all_reduce.py
  benchmark:  torchrun --nproc_per_node=2 03_all_reduce.py --benchmark --json allreduce.json --plot allreduce.png
  N GPUs:     torchrun --nproc_per_node=N 03_all_reduce.py        (nccl, one GPU per rank)
  2 nodes:    torchrun --nnodes=2 --node_rank=K --nproc_per_node=G --master_addr=HOST --master_port=29500 03_all_reduce.py
"""

import argparse
import json
import math
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

# --- distributed setup (the same block in every script: copied, not imported, so each file runs alone) ---
RANK, WORLD = 0, 1


def print0(*msg):
    """The rank-0 narrative: printed once, not N times."""
    if RANK == 0:
        print(*msg, flush=True)


def log(*msg):
    """A per-rank line, tagged so interleaved output stays readable."""
    print(f"[rank {RANK}/{WORLD}] " + " ".join(map(str, msg)), flush=True)  # one write: no interleaving


def setup(args, min_world=2):
    """Join the process group. Global RANK names the process; LOCAL_RANK picks its GPU on this node."""
    global RANK, WORLD
    if "RANK" not in os.environ:
        sys.exit(f"error: launch with torchrun, e.g. torchrun --nproc_per_node=2 {os.path.basename(__file__)}")
    RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if WORLD < min_world:
        sys.exit(f"error: needs at least {min_world} ranks, got WORLD_SIZE={WORLD} (use --nproc_per_node={min_world})")
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        sys.exit("error: --device cuda but CUDA is not available")
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if use_cuda else "cpu")
    backend = args.backend or ("nccl" if use_cuda else "gloo")
    if use_cuda:
        torch.cuda.set_device(device)  # before init, so NCCL binds this rank to its own GPU
    # A timeout turns a dead peer into an error after --timeout-s instead of a silent 30-minute hang.
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout_s),
                            device_id=device if backend == "nccl" else None)
    return device


def teardown():
    if dist.is_initialized():
        dist.destroy_process_group()


# --- the idea: a ring all-reduce on point-to-point messages ---
_inboxes = {}  # (dtype, device) -> receive buffer kept between calls: fresh memory costs page faults


def _inbox(like, numel):
    buf = _inboxes.get((like.dtype, like.device))
    if buf is None or buf.numel() < numel:
        buf = _inboxes[(like.dtype, like.device)] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel]


def _exchange(send, recv, right, left, nccl):
    """Send to the right neighbour while receiving from the left one; return once the receive has landed.

    Returns the send still in flight: its buffer must stay untouched until it completes, but nothing else has
    to wait for it, so the caller adds the received chunk while the last bytes of its own go out.
    On NCCL both directions must be posted together as one group (batch_isend_irecv): a rank alone in a
    blocking send would wait for a receive its neighbour has not posted yet, and so on around the ring.
    gloo runs each isend/irecv in the background by itself; there the batching wrapper only adds overhead.
    """
    if nccl:
        ops = [dist.P2POp(op, t, peer) for op, t, peer in ((dist.isend, send, right), (dist.irecv, recv, left))
               if t.numel()]  # with fewer elements than ranks some chunks are empty: both neighbours skip them
        for req in dist.batch_isend_irecv(ops) if ops else []:
            req.wait()  # on a GPU this only orders streams; the host does not block
        return []
    # Which one to post first was measured on gloo (CPU). With 2 ranks both neighbours are the same peer, and
    # posting the send first made 64 KiB-1 MiB all-reduces 25-35% faster, while the receive first made 64 MiB
    # ones ~10% faster. With 3 ranks the receive first was as fast or faster at every size.
    recv_first = left != right or recv.numel() * recv.element_size() >= 4 << 20
    early = dist.irecv(recv, left) if recv_first and recv.numel() else None
    sending = [dist.isend(send, right)] if send.numel() else []
    if recv.numel():
        (early or dist.irecv(recv, left)).wait()
    return sending


def _wait(reqs):
    for req in reqs:
        req.wait()
    reqs.clear()


def ring_all_reduce(tensor):
    """Sum ``tensor`` over all ranks, in place, with a ring of point-to-point messages. Returns it.

    Any shape, any number of elements, float or integer dtypes. Every rank ends bit-identical: each chunk is
    summed by exactly one rank (its owner) and then copied, never re-added, to the others.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return tensor
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    chunks = flat.tensor_split(world)  # N views; sizes differ by at most one element, chunk 0 the largest
    right, left, nccl = (rank + 1) % world, (rank - 1) % world, dist.get_backend() == "nccl"
    sending = []  # sends still draining
    # Reduce-scatter. In step s, rank r sends chunk r-s and receives chunk r-s-1, adding it to its own.
    # After N-1 steps rank r holds the complete sum of chunk r+1: it is that chunk's owner.
    # No step writes to a chunk an earlier step sent, so the sends need not finish before the next step.
    for s in range(world - 1):
        mine, theirs = chunks[(rank - s) % world], chunks[(rank - s - 1) % world]
        inbox = _inbox(flat, theirs.numel())
        sending += _exchange(mine, inbox, right, left, nccl)
        theirs += inbox
    _wait(sending)  # the all-gather overwrites the very chunks the reduce-scatter sent
    # All-gather. The owners pass finished chunks on; receivers overwrite (no addition), so the bits match.
    for s in range(world - 1):
        sending += _exchange(chunks[(rank + 1 - s) % world], chunks[(rank - s) % world], right, left, nccl)
    _wait(sending)  # the caller may write to the tensor as soon as we return
    if flat.data_ptr() != tensor.data_ptr():  # we worked on a contiguous copy: write it back
        tensor.copy_(flat.view_as(tensor))
    return tensor


# --- 1. reduce ops, 2. ring check, 3. gradient averaging ---
def check_reduce_ops(device):
    n = WORLD
    x = torch.full((3,), float(RANK + 1), device=device)  # rank r holds r+1
    expected = {dist.ReduceOp.SUM: n * (n + 1) / 2, dist.ReduceOp.PRODUCT: math.factorial(n),
                dist.ReduceOp.MIN: 1, dist.ReduceOp.MAX: n}
    for op, want in expected.items():
        y = x.clone()
        dist.all_reduce(y, op=op)
        assert torch.all(y == want), (op, y, want)
        print0(f"  {str(op).split('.')[-1]:<8} of (rank+1) = {y[0].item():g}  (closed form {want:g})")
    if dist.get_backend() == "nccl":  # NCCL has no bitwise reductions (gloo and MPI do)
        print0("  BOR      skipped: not supported by nccl")
        return
    bits = torch.tensor([1 << RANK], device=device)  # bitwise ops need integers
    dist.all_reduce(bits, op=dist.ReduceOp.BOR)
    assert bits.item() == (1 << n) - 1
    print0(f"  BOR      of 1<<rank  = {bits.item()}  (closed form 2^{n}-1)")


def check_ring(device):
    for shape, dtype in [((1000, 37), torch.float32), ((3,), torch.int64), ((WORLD - 1,), torch.float64)]:
        g = torch.Generator().manual_seed(RANK)
        x = (torch.randn(shape, generator=g) * 10).to(dtype).to(device)
        ours, lib = ring_all_reduce(x.clone()), x.clone()
        dist.all_reduce(lib)
        # Sums in a different order can differ in the last float bit; integers must match exactly.
        ok = torch.equal(ours, lib) if not dtype.is_floating_point else torch.allclose(ours, lib, rtol=1e-5, atol=1e-5)
        assert ok, f"ring_all_reduce != dist.all_reduce for {shape} {dtype}"
        print0(f"  ring_all_reduce == dist.all_reduce  shape={tuple(shape)} dtype={dtype}")


def check_grad_averaging(device):
    torch.manual_seed(0)  # same seed on every rank: same model and same global batch
    model = torch.nn.Linear(10, 1).to(device)
    x, y = torch.randn(8 * WORLD, 10, device=device), torch.randn(8 * WORLD, 1, device=device)
    torch.nn.functional.mse_loss(model(x), y).backward()
    reference = model.weight.grad.clone()  # one process, whole batch
    model.zero_grad()
    shard = slice(8 * RANK, 8 * (RANK + 1))  # each rank sees only its 8 samples
    torch.nn.functional.mse_loss(model(x[shard]), y[shard]).backward()
    # Each rank's loss is a mean over its shard, so the SUM of N gradients is N times the global mean:
    # divide by N. (Dividing before the sum, as DDP does, keeps fp16 from overflowing.)
    grad = ring_all_reduce(model.weight.grad) / WORLD
    assert torch.allclose(grad, reference, atol=1e-6), (grad, reference)
    print0(f"  ring_all_reduce(grad) / {WORLD} == single-process gradient on the whole batch of {8 * WORLD}")


# --- 4. benchmark: ring vs library, interleaved so machine noise hits both alike ---
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # GPU collectives are asynchronous: wait before reading the clock


def benchmark(args, device):
    sizes = [s for s in (1024 * 4 ** k for k in range(12)) if args.min_bytes <= s <= args.max_bytes]
    impls = {"ring": ring_all_reduce, "library": dist.all_reduce}
    bus = 2 * (WORLD - 1) / WORLD  # bytes each rank must send per byte reduced (nccl-tests' busbw factor)
    rows = []
    for nbytes in sizes:
        x = torch.zeros(nbytes // 4, device=device)  # sums of zeros stay zero: no overflow over many calls
        # As nccl-tests do, time a run of back-to-back calls and divide: one call of a small message is shorter
        # than the clock's noise and the skew between ranks leaving the barrier.
        calls = max(1, min(20, (16 << 20) // nbytes))
        times = {name: [] for name in impls}
        for i in range(args.iters + 1):  # round 0 warms up (connections, buffers) and is not timed
            # Interleaved, and the order flips every round (ring, library, library, ring, ...): noise hits both
            # alike, and neither always runs first after the barrier.
            for name in (list(impls) if i % 2 else list(impls)[::-1]):
                sync(device)
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    impls[name](x)
                sync(device)
                if i:
                    times[name].append((time.perf_counter() - t0) / calls)
        # A collective is as slow as its slowest rank: take the max over ranks of each repetition.
        t = torch.tensor([times["ring"], times["library"]], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        row = {"bytes": nbytes}
        for name, ts in zip(impls, t.tolist()):
            q1, med, q3 = quartiles(ts)
            row.update({f"{name}_ms": med * 1e3, f"{name}_ms_p25": q1 * 1e3, f"{name}_ms_p75": q3 * 1e3,
                        f"{name}_algbw_gbps": nbytes / med / 1e9, f"{name}_busbw_gbps": nbytes / med / 1e9 * bus})
        # The ratio is taken per round (the two runs of one round were seconds apart) and then the median over
        # rounds: a slow spell of the machine slows both sides of its round and cancels out of the ratio.
        q1, med, q3 = quartiles([lib / ring for ring, lib in zip(*t.tolist())])
        row.update({"ring_over_library_busbw": med, "ring_over_library_busbw_p25": q1, "ring_over_library_busbw_p75": q3})
        rows.append(row)
    print0(f"\nall-reduce float32, world_size={WORLD}, backend={dist.get_backend()}, torch {torch.__version__}, "
           f"median of {args.iters} rounds (max over ranks); busbw = algbw * 2(N-1)/N; "
           f"ring/library = median of the per-round busbw ratios")
    print0("| size | ring ms (p25-p75) | library ms (p25-p75) | ring busbw GB/s | library busbw GB/s | ring/library (p25-p75) |")
    print0("|---:|---:|---:|---:|---:|---:|")
    spread = lambda r, n: f"{r[n + '_ms']:8.3f} ({r[n + '_ms_p25']:.3f}-{r[n + '_ms_p75']:.3f})"  # noqa: E731
    for r in rows:
        print0(f"| {human(r['bytes']):>7} | {spread(r, 'ring')} | {spread(r, 'library')} | {r['ring_busbw_gbps']:7.3f} "
               f"| {r['library_busbw_gbps']:7.3f} | {r['ring_over_library_busbw']:5.2f} ({r['ring_over_library_busbw_p25']:.2f}-"
               f"{r['ring_over_library_busbw_p75']:.2f}) |")
    if RANK == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"world_size": WORLD, "backend": dist.get_backend(), "device": device.type,
                       "torch": torch.__version__, "rows": rows}, f, indent=1)
        print0(f"wrote {args.json}")
    if RANK == 0 and args.plot:
        plot(rows, args.plot)
        print0(f"wrote {args.plot}")
    return rows


def quartiles(xs):
    """(p25, median, p75) of a list of timings or ratios."""
    return statistics.quantiles(xs, n=4) if len(xs) > 1 else (xs[0],) * 3


def human(nbytes):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:g} {unit}"
        nbytes /= 1024


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    x = [r["bytes"] for r in rows]
    for name in ("ring", "library"):
        ax.plot(x, [r[f"{name}_busbw_gbps"] for r in rows], marker="o",
                label="ring_all_reduce (ours)" if name == "ring" else "dist.all_reduce")
    ax.set(xscale="log", xlabel="message size (bytes)", ylabel="busbw (GB/s)",
           title=f"all-reduce busbw, {WORLD} ranks, {dist.get_backend()}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(args):
    device = setup(args)
    print0(f"world_size={WORLD} backend={dist.get_backend()} device={device.type} torch={torch.__version__}")
    if args.benchmark:
        benchmark(args, device)
        print0(f"OK benchmark finished on {WORLD} ranks")
    else:
        print0("1. reduce ops")
        check_reduce_ops(device)
        print0("2. hand-written ring")
        check_ring(device)
        print0("3. gradient averaging")
        check_grad_averaging(device)
        dist.barrier()
        print0(f"OK reduce ops, ring_all_reduce and gradient averaging checked on {WORLD} ranks")
    teardown()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--benchmark", action="store_true", help="time ring_all_reduce vs dist.all_reduce per size")
    p.add_argument("--min-bytes", type=int, default=1 << 10, help="smallest benchmark message")
    p.add_argument("--max-bytes", type=int, default=64 << 20, help="largest benchmark message")
    p.add_argument("--iters", type=int, default=100, help="timed rounds per size and implementation")
    p.add_argument("--json", default=None, help="with --benchmark: write the results to this JSON file")
    p.add_argument("--plot", default=None, help="with --benchmark: write busbw vs size to this PNG")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda if available")
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None, help="default: nccl on cuda, gloo on cpu")
    p.add_argument("--timeout-s", type=float, default=120, help="process-group timeout: a dead peer fails, not hangs")
    a = p.parse_args()
    if a.min_bytes < 4 or a.max_bytes < a.min_bytes or a.iters < 1 or a.timeout_s <= 0:
        p.error("need 4 <= --min-bytes <= --max-bytes, --iters >= 1 and --timeout-s > 0")
    main(a)
