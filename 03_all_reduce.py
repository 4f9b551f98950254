"""03 - All-reduce: every rank ends with the sum of everyone's tensor. DDP is this, applied to gradients.

ring_all_reduce() is the bandwidth-optimal ring by hand: a reduce-scatter (N-1 steps; each rank ends owning the sum
of one chunk), then an all-gather (N-1 steps; the owned chunks go round). Each rank sends 2(N-1)/N of the data
whatever N is: that is why rings scale. pipelined_ring_all_reduce(), the same ring in pieces, is as fast as gloo's.

Run it (any N >= 2):
  CPU:      torchrun --nproc_per_node=3 03_all_reduce.py [--trace]     (--trace: the ring step by step)
  N GPUs:   torchrun --nproc_per_node=N 03_all_reduce.py        (nccl, one GPU per rank)
  2 nodes:  torchrun --nnodes=2 --node_rank=K --nproc_per_node=G --master_addr=HOST --master_port=29500 03_all_reduce.py
"""

import argparse
import math
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


# --- the idea: a ring all-reduce on point-to-point messages ---
def ring_all_reduce(tensor, trace=None):
    """Sum ``tensor`` over all ranks, in place, with a ring of point-to-point messages; returns it. Any shape and
    size, float or integer. Every rank ends bit-identical: each chunk is summed by one rank (its owner), then copied,
    never re-added. ``trace(phase, step, chunk sent, chunk received, chunks)``, if given, runs after every step."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if tensor.is_cuda and dist.get_backend() == "gloo":  # gloo's send/recv move host memory only: ring a CPU copy
        return tensor.copy_(ring_all_reduce(tensor.cpu(), trace))
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    chunks = flat.tensor_split(world)  # N views; sizes differ by at most one element, chunk 0 the largest
    inbox = torch.empty_like(chunks[0])  # a receive buffer for any chunk
    right, left = (rank + 1) % world, (rank - 1) % world
    # Reduce-scatter. In step s, rank r sends chunk r-s and receives chunk r-s-1, adding it to its own.
    # After N-1 steps rank r holds the complete sum of chunk r+1: it is that chunk's owner.
    for s in range(world - 1):
        i_send, i_recv = (rank - s) % world, (rank - s - 1) % world
        exchange(chunks[i_send], inbox[:chunks[i_recv].numel()], right, left)
        chunks[i_recv].add_(inbox[:chunks[i_recv].numel()])
        if trace:
            trace("reduce-scatter", s, i_send, i_recv, chunks)
    # All-gather. The owners pass finished chunks on; receivers overwrite (no addition), so the bits match.
    for s in range(world - 1):
        i_send, i_recv = (rank + 1 - s) % world, (rank - s) % world
        exchange(chunks[i_send], chunks[i_recv], right, left)
        if trace:
            trace("all-gather", s, i_send, i_recv, chunks)
    if flat.data_ptr() != tensor.data_ptr():  # we worked on a contiguous copy: write it back
        tensor.copy_(flat.view_as(tensor))
    return tensor


def exchange(send, recv, right, left):
    """Send right and receive from the left at once: blocking sends all round the ring would deadlock (01
    --blocking). Empty chunks (fewer elements than ranks) are skipped; on a GPU, wait() only orders the streams."""
    ops = [dist.P2POp(dist.isend, send, right), dist.P2POp(dist.irecv, recv, left)]
    ops = [op for op in ops if op.tensor.numel()]
    if ops:
        wait_all(dist.batch_isend_irecv(ops))


def wait_all(reqs):
    for req in reqs:
        req.wait()
    reqs.clear()


# --- the same ring, pipelined: cut into pieces, piece j is added and sent on while piece j+1 is on the wire ---
PIECE_BYTES = 1 << 20  # benchmarks/README.md: 1-4 MiB alike on 2 ranks here; 64 KiB (a wake-up each), 2.5x slower
_staging = {}  # dtype -> receive buffers kept between calls: fresh memory costs a page fault per 4 KiB


def pipelined_ring_all_reduce(tensor, piece_bytes=PIECE_BYTES):
    """ring_all_reduce in messages of at most ``piece_bytes``: the same additions in the same order (so the same bits
    on any N), the same bytes sent. A GPU tensor goes to ring_all_reduce: its GPU queues transfers and adds alike."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if tensor.is_cuda:
        return ring_all_reduce(tensor)
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    chunks = flat.tensor_split(world)
    size = (world - 1) * chunks[0].numel()  # staging: a chunk for each step of the reduce-scatter
    n = max(1, math.ceil(chunks[0].numel() * flat.element_size() / piece_bytes))  # pieces per chunk

    def pieces(x):  # x's pieces that hold anything (fewer elements than pieces leave the last ones empty)
        return [p for p in x.tensor_split(n) if p.numel()]

    if _staging.get(flat.dtype, flat[:0]).numel() < size:
        _staging[flat.dtype] = torch.empty(size, dtype=flat.dtype)
    staging = _staging[flat.dtype][:size].view(world - 1, chunks[0].numel())  # row t: step t's chunk
    right, left, steps = (rank + 1) % world, (rank - 1) % world, 2 * (world - 1)
    # As in the lesson, step t receives chunk r-t-1: the first N-1 steps add it, the others copy it in place. Every
    # receive is posted up front, so every send finds its receive waiting and goes straight onto the wire. In place is
    # safe before our own send of that chunk is waited for: what arrives there already contains all that we sent.
    arriving = [chunks[(rank - t - 1) % world] for t in range(steps)]
    landing = [staging[t][:c.numel()] if t < world - 1 else c for t, c in enumerate(arriving)]
    receives = [[dist.irecv(p, left) for p in pieces(into)] for into in landing]
    sends = [dist.isend(p, right) for p in pieces(chunks[rank])]  # step 0 sends our own chunk
    for t in range(steps):
        for piece, landed, req in zip(pieces(arriving[t]), pieces(landing[t]), receives[t]):
            req.wait()
            if t < world - 1:
                piece.add_(landed)
            if t < steps - 1:  # piece j moves on at once, while piece j+1 is still arriving
                sends.append(dist.isend(piece, right))
    wait_all(sends)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor


# --- the ring step by step (--trace), then main: the rings checked against the library ---
def trace_ring(device):
    """Every step of ring_all_reduce on one element per chunk. Rank r starts with (c+1) * 10**r in chunk c, so each
    digit of a sum names the ranks in it (303 = rank 0's 3 + rank 2's 300); int64, so that the sums are exact."""
    start = torch.tensor([(c + 1) * 10**RANK for c in range(WORLD)], device=device)

    def holds(chunks):  # WORLD digits: the widest sum, up to 8 ranks
        return "[" + " | ".join(f"{c.item():>{WORLD}}" for c in chunks) + "]"

    def step(phase, s, sent, received, chunks):
        verb = "added" if phase == "reduce-scatter" else "copied"
        print0(f"{phase}, step {s + 1} of {WORLD - 1}: each rank sends a chunk right; the one from the left is {verb}")
        log_in_rank_order(f"holds {holds(chunks)}  sent chunk {sent} to rank {(RANK + 1) % WORLD}, {verb} chunk "
                          f"{received} from rank {(RANK - 1) % WORLD}")

    print0(f"--trace: {WORLD} chunks of one element; rank r starts with (c+1)*10^r in chunk c")
    log_in_rank_order(f"holds {holds(start.tensor_split(WORLD))}")
    result, library = ring_all_reduce(start.clone(), trace=step), start.clone()
    dist.all_reduce(library)
    assert torch.equal(result, library), (result, library)
    print0(f"every rank holds {holds(result.tensor_split(WORLD))} == dist.all_reduce")


def main(args):
    if WORLD < 2:  # a ring of one has no neighbour to pass chunks to
        raise UsageError(f"needs 2 or more ranks: launch with torchrun, e.g. torchrun --nproc_per_node=2 {sys.argv[0]}")
    device = setup(args)
    if args.trace:
        trace_ring(device)
    for shape, dtype in [((1000, 37), torch.float32), ((3,), torch.int64), ((WORLD - 1,), torch.float64)]:
        x = (torch.randn(shape, generator=torch.Generator().manual_seed(RANK)) * 10).to(dtype).to(device)
        ours, piped, lib = ring_all_reduce(x.clone()), pipelined_ring_all_reduce(x.clone(), 4096), x.clone()
        dist.all_reduce(lib)
        # Two terms add alike in either order; three or more, summed in another order, may round differently.
        exact = WORLD == 2 or not dtype.is_floating_point
        assert torch.equal(ours, lib) if exact else torch.allclose(ours, lib, rtol=1e-5, atol=1e-5), (shape, dtype)
        assert torch.equal(piped, ours), f"pipelined_ring_all_reduce != ring_all_reduce for {shape} {dtype}"
        print0(f"  ring {'==' if exact else '~='} library, pipelined == ring  shape={tuple(shape)} dtype={dtype}")
    done = torch.ones(1, device=device)
    dist.all_reduce(done)  # every rank reports in, so the OK below speaks for all of them
    assert done.item() == WORLD
    print0(f"OK ring_all_reduce and pipelined_ring_all_reduce checked against dist.all_reduce on {WORLD} ranks")


# --- plumbing the lesson calls: ordered output, flags ---
def log_in_rank_order(line):  # every rank's line, printed by rank 0 in rank order (lines printed by each race)
    lines = [None] * WORLD
    dist.all_gather_object(lines, line)
    for r, text in enumerate(lines):
        print0(f"[rank {r}/{WORLD}] {text}")


def parse_args():
    p = Parser(__doc__)
    p.add_argument("--trace", action="store_true", help="first, print every step of the ring (best on 3 or 4 ranks)")
    args = p.parse_args()
    if args.trace and WORLD > 8:  # checked before any process group starts
        p.error(f"--trace prints every step of every rank: run it on 2 to 8 ranks, not {WORLD}")
    return args


# --- setup: the same block in every numbered script, copied so that each file runs alone ---
RANK, WORLD = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))  # from torchrun


class UsageError(Exception): ...  # a bad flag or input: one `error:` line (run()), exit status 2


def print0(*msg):  # rank 0 tells the story, once. One write, so that lines from ranks never mix.
    if RANK == 0:
        print(" ".join(map(str, msg)) + "\n", end="", flush=True)


def at_least(low, kind=int, below=math.inf):  # a number flag's type: low <= value < below
    def parse(text):
        if not low <= kind(text) < below:
            raise argparse.ArgumentTypeError(f"must be >= {low} and < {below}, got {text}")
        return kind(text)
    return parse


class Parser(argparse.ArgumentParser):  # the flags every script shares
    def __init__(self, doc, timeout_s=120):
        super().__init__(description=doc.split("\n")[0],
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        self.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
        self.add_argument("--backend", choices=["gloo", "nccl"], help="default: nccl if GPUs")
        self.add_argument("--timeout-s", type=at_least(1, float), default=timeout_s,
                          help="how long a rank waits for a peer")

    def error(self, message): raise UsageError(message)  # one line from rank 0 (run())


def setup(args):  # pick this rank's device, then join the group
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = 0 if args.device == "cpu" else torch.cuda.device_count()  # --device cpu never asks CUDA
    backend = args.backend or ("nccl" if gpus >= local_world else "gloo")  # NCCL: a GPU per rank
    if (args.device == "cuda" and gpus == 0) or (backend == "nccl" and gpus < local_world):
        raise UsageError(f"--backend {backend}: {gpus} CUDA GPU(s) for {local_world} ranks")
    on_gpu = gpus >= local_world or args.device == "cuda"  # gloo lets the ranks share GPUs
    device = torch.device(f"cuda:{local_rank % gpus}" if on_gpu else "cpu")
    if device.type == "cuda":  # before init, so that NCCL binds this rank to its GPU
        torch.cuda.set_device(device)
    print0(f"device: {device.type}, {backend} "
           f"(--device {args.device}, {gpus} GPU(s) for {local_world} ranks/node)")
    alone = {} if "RANK" in os.environ else dict(store=dist.HashStore(), rank=0, world_size=1)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout_s), **alone)
    return device


def run(main, parse_args):  # a dead peer ends in the library's timeout error, never a hang
    try:
        main(parse_args())
    except UsageError as e:  # every rank stops alike, with exit status 2. Rank 0 says why.
        print0(f"error: {e}")
        os._exit(2)  # at once: tearing down a live group can abort in gloo's threads (SIGABRT)
    dist.destroy_process_group()  # main() always joins the group first
    time.sleep(0.05)  # gloo's threads drop their last tensors before exit, or it can abort


if __name__ == "__main__":
    run(main, parse_args)
