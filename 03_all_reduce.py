"""03 - All-reduce. Every rank ends with the sum of everyone's tensor. DDP does this to gradients.

ring_all_reduce() does it by hand, with the ranks in a ring, in two phases of N-1 steps. First,
each rank adds up one chunk with its neighbours, until it owns that chunk's whole sum. This is a
reduce-scatter. Then the ranks pass the finished chunks round. This is an all-gather. Each rank
sends 2(N-1)/N times the data, just under twice, however many ranks. That is why rings scale.
A second read, pipelined_ring_all_reduce(), runs the ring in pieces, as fast as gloo's from 16 MiB.

Run it on the CPU, where --trace prints the ring step by step, or on N GPUs:
  torchrun --nproc_per_node=3 03_all_reduce.py [--trace]
  torchrun --nproc_per_node=N 03_all_reduce.py   # on N GPUs, one per rank, with NCCL
On 2 nodes of G processes each, run this on node K = 0 and on node K = 1:
  torchrun --nnodes=2 --node_rank=K --nproc_per_node=G --master_addr=HOST 03_all_reduce.py
"""

import argparse
import contextlib
import math
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


# --- the idea: a ring all-reduce on point-to-point messages ---
def ring_all_reduce(tensor, trace=None):
    """Sum tensor over all ranks, in place, with messages around a ring. Returns tensor.

    It takes any shape and size, float or integer. Every rank ends with the same bits, because one
    rank adds up each chunk (its owner) and the others only copy it. If trace is given, it runs
    after every step, as trace(phase, step, chunk sent, chunk received, chunks)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    right, left = (rank + 1) % world, (rank - 1) % world
    with flat_sendable(tensor) as flat:  # One flat tensor, in memory the backend can send.
        chunks = flat.tensor_split(world)  # N views. Sizes differ by one at most.
        inbox = torch.empty_like(chunks[0])  # Room for any chunk. Chunk 0 is the largest.
        # Reduce-scatter. In step s, rank r sends chunk r-s and adds the chunk r-s-1 that arrives.
        # After N-1 steps, rank r holds the whole sum of chunk r+1. It is that chunk's owner.
        for s in range(world - 1):
            i_send, i_recv = (rank - s) % world, (rank - s - 1) % world
            exchange(chunks[i_send], inbox[:chunks[i_recv].numel()], right, left)
            chunks[i_recv].add_(inbox[:chunks[i_recv].numel()])
            if trace:
                trace("reduce-scatter", s, i_send, i_recv, chunks)
        # All-gather. Owners pass finished chunks on. The rest copy them, never add, so bits match.
        for s in range(world - 1):
            i_send, i_recv = (rank + 1 - s) % world, (rank - s) % world
            exchange(chunks[i_send], chunks[i_recv], right, left)
            if trace:
                trace("all-gather", s, i_send, i_recv, chunks)
    return tensor


def exchange(send, recv, right, left):
    """Send to the right and receive from the left, both at once. Blocking sends all round the ring
    would deadlock. Empty chunks, when there are fewer elements than ranks, are skipped."""
    ops = [dist.P2POp(dist.isend, send, right), dist.P2POp(dist.irecv, recv, left)]
    ops = [op for op in ops if op.tensor.numel()]
    if ops:
        wait_all(dist.batch_isend_irecv(ops))  # On a GPU, wait() only orders the streams.


def wait_all(reqs):
    for req in reqs:
        req.wait()


@contextlib.contextmanager
def flat_sendable(tensor):
    """tensor's memory seen flat, or a flat copy that is written back at the end. It copies when
    tensor is not contiguous, or on a GPU under gloo, whose send and recv move CPU memory only."""
    flat = tensor.cpu() if tensor.is_cuda and dist.get_backend() == "gloo" else tensor
    flat = flat.contiguous().view(-1)  # The same memory if it was contiguous already.
    yield flat
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))


# --- a second read: the same ring, pipelined. Skip it on a first pass. ---
PIECE_BYTES = 1 << 20  # 1-4 MiB run alike here. 64 KiB is 2.5x slower (benchmarks/README.md).
_staging = {}  # dtype -> receive buffers, kept between calls, since new memory is slow at first.


def pipelined_ring_all_reduce(tensor, piece_bytes=PIECE_BYTES):
    """ring_all_reduce with each chunk cut into pieces of piece_bytes at most. Piece j is added and
    sent on while piece j+1 is on the wire. The additions and their order are the same, so are the
    bits on any N, and so are the bytes sent. A GPU tensor goes to ring_all_reduce. Its GPU queues
    transfers and additions alike, so they overlap already."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if tensor.is_cuda:
        return ring_all_reduce(tensor)
    with flat_sendable(tensor) as flat:
        chunks = flat.tensor_split(world)
        size = (world - 1) * chunks[0].numel()  # Staging: a chunk for each reduce-scatter step.
        n = max(1, math.ceil(chunks[0].numel() * flat.element_size() / piece_bytes))  # Per chunk.

        def pieces(x):  # x's pieces that hold anything. With few elements, the last ones are empty.
            return [p for p in x.tensor_split(n) if p.numel()]

        if _staging.get(flat.dtype, flat[:0]).numel() < size:
            _staging[flat.dtype] = torch.empty(size, dtype=flat.dtype)
        staging = _staging[flat.dtype][:size].view(world - 1, chunks[0].numel())  # Row t: step t.
        right, left, steps = (rank + 1) % world, (rank - 1) % world, 2 * (world - 1)
        # As in the lesson, step t receives chunk r-t-1. The first N-1 steps add it, the rest copy
        # it in place. Every receive is posted up front, so each send goes straight onto the wire.
        # Landing in place is safe before our own send of that chunk is done. It holds what we sent.
        arriving = [chunks[(rank - t - 1) % world] for t in range(steps)]
        landing = [staging[t][:c.numel()] if t < world - 1 else c for t, c in enumerate(arriving)]
        receives = [[dist.irecv(p, left) for p in pieces(into)] for into in landing]
        sends = [dist.isend(p, right) for p in pieces(chunks[rank])]  # Step 0 sends our own chunk.
        for t in range(steps):
            for piece, landed, req in zip(pieces(arriving[t]), pieces(landing[t]), receives[t]):
                req.wait()
                if t < world - 1:
                    piece.add_(landed)
                if t < steps - 1:  # Piece j moves on at once, while piece j+1 is still arriving.
                    sends.append(dist.isend(piece, right))
        wait_all(sends)
    return tensor


# --- the ring step by step (--trace), then main: the rings checked against the library ---
def trace_ring(device):
    """Every step of ring_all_reduce, on one element per chunk. Rank r starts with (c+1) * 10**r in
    chunk c. So each digit of a sum names the ranks in it (303 is rank 0's 3 plus rank 2's 300)."""
    start = torch.tensor([(c + 1) * 10**RANK for c in range(WORLD)], device=device)

    def holds(chunks):  # WORLD digits, as wide as the widest sum. There are 8 ranks at most.
        return "[" + " | ".join(f"{c.item():>{WORLD}}" for c in chunks) + "]"

    def step(phase, s, sent, received, chunks):
        verb, do = ("added", "adds") if phase == "reduce-scatter" else ("copied", "copies")
        print0(f"{phase}, step {s + 1} of {WORLD - 1}: each rank sends a chunk right, and {do} "
               "the one from its left")
        log_in_rank_order(f"holds {holds(chunks)}  sent chunk {sent} to rank {(RANK + 1) % WORLD}, "
                          f"{verb} chunk {received} from rank {(RANK - 1) % WORLD}")

    print0(f"--trace: {WORLD} chunks of one element; rank r starts with (c+1)*10^r in chunk c")
    log_in_rank_order(f"holds {holds(start.tensor_split(WORLD))}")
    result, library = ring_all_reduce(start.clone(), trace=step), start.clone()
    dist.all_reduce(library)
    assert torch.equal(result, library), (result, library)
    print0(f"every rank holds {holds(result.tensor_split(WORLD))} == dist.all_reduce")


def main(args):
    if WORLD < 2:  # A ring of one has no neighbour to pass chunks to.
        raise UsageError("this lesson needs 2 or more ranks, so launch with torchrun, "
                         f"e.g. torchrun --nproc_per_node=2 {sys.argv[0]}")
    device = setup(args)
    if args.trace:
        trace_ring(device)
    for shape, dtype in [((1000, 37), torch.float32), ((3,), torch.int64),
                         ((WORLD - 1,), torch.float64)]:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(RANK)) * 10
        x, lib = x.to(dtype).to(device), x.to(dtype).to(device)
        ours, piped = ring_all_reduce(x.clone()), pipelined_ring_all_reduce(x.clone(), 4096)
        dist.all_reduce(lib)
        # Two terms add alike in either order. Three or more may round differently in another order.
        exact = WORLD == 2 or not dtype.is_floating_point
        close = torch.equal(ours, lib) if exact else torch.allclose(ours, lib, rtol=1e-5, atol=1e-5)
        assert close, (shape, dtype)
        assert torch.equal(piped, ours), f"pipelined ring != ring for {shape} {dtype}"
        print0(f"  ring {'==' if exact else '~='} library, pipelined == ring  "
               f"shape={tuple(shape)} dtype={dtype}")
    done = torch.ones(1, device=device)
    dist.all_reduce(done)  # Every rank reports in, so the OK below speaks for all of them.
    assert done.item() == WORLD
    print0("OK ring_all_reduce and pipelined_ring_all_reduce checked against dist.all_reduce "
           f"on {WORLD} ranks")


# --- plumbing the lesson calls: ordered output, flags ---
def log_in_rank_order(line):  # Rank 0 prints every rank's line, in rank order, so none race.
    lines = [None] * WORLD
    dist.all_gather_object(lines, line)
    for r, text in enumerate(lines):
        print0(f"[rank {r}/{WORLD}] {text}")


def parse_args():
    p = Parser(__doc__)
    p.add_argument("--trace", action="store_true", help="first, print the ring step by step")
    args = p.parse_args()
    if args.trace and WORLD > 8:  # Checked before any process group starts.
        p.error(f"--trace prints every step of every rank, so run it on 2 to 8 ranks, not {WORLD}")
    return args


# --- setup: the same block in every numbered script, copied so that each file runs alone ---
RANK, WORLD = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))  # from torchrun


class UsageError(Exception): ...  # A bad flag or input. run() prints one line, and exits 2.


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


def run(main, parse_args):  # Runs main. setup()'s timeout ends a job whose peer died.
    try:
        main(parse_args())
    except UsageError as e:  # Every rank stops alike, with exit status 2. Rank 0 says why.
        print0(f"error: {e}")
        os._exit(2)  # Exit at once. Tearing down a live group can crash gloo's threads.
    dist.destroy_process_group()  # main() always joins the group first.
    time.sleep(0.05)  # Give gloo's threads a moment to let go of tensors, or exit can crash.


if __name__ == "__main__":
    run(main, parse_args)
