"""02 - Broadcast. One rank's tensor ends up on every rank, and DDP starts with one.

It teaches three things, in this order.
  1. dist.broadcast from a source rank you choose. Each rank prints its tensor before and after.
  2. The same by hand, on send and recv. The ranks that hold the data double in number every round,
     like a tree's branches. So N ranks need ceil(log2 N) rounds, not N-1 sends from the source.
     The script checks that this tree, a binomial tree, gives what dist.broadcast gives.
  3. Why DDP broadcasts when it starts. Replicas built with different seeds differ. Broadcasting
     rank 0's parameters and buffers makes them identical, and every rank checks that.

Run it on the CPU with rank 2 of 3 as the source, or on N GPUs:
  torchrun --nproc_per_node=3 02_broadcast.py --src 2
  torchrun --nproc_per_node=N 02_broadcast.py   # on N GPUs, one per rank, with NCCL
On 2 nodes of G processes each, run this on node K = 0 and on node K = 1:
  torchrun --nnodes=2 --node_rank=K --nproc_per_node=G --master_addr=HOST 02_broadcast.py
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
import torch.nn as nn


# --- the idea: a binomial-tree broadcast on point-to-point messages ---
def tree_broadcast(tensor, src=0):
    """Overwrite tensor on every rank with src's copy, in place. Returns the number of rounds.

    The ranks are renumbered so that the source is vrank 0. In round k, the 2**k ranks that hold
    the data (vranks below 2**k) each send it to vrank + 2**k. Within a round, every rank is in one
    pair at most. So blocking send and recv cannot deadlock, on gloo or NCCL.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    vrank = (rank - src) % world
    rounds = math.ceil(math.log2(world)) if world > 1 else 0
    with sendable(tensor) as t:  # A CPU copy under gloo, which sends CPU memory only.
        for k in range(rounds):
            step = 1 << k
            if vrank < step and vrank + step < world:
                dist.send(t, dst=(vrank + step + src) % world)
            elif step <= vrank < 2 * step:
                dist.recv(t, src=(vrank - step + src) % world)
    return rounds


@contextlib.contextmanager
def sendable(tensor):
    """Yield the tensor itself, or a CPU copy that is written back at the end. gloo's send and recv
    move CPU memory only. Its CUDA support covers the collectives."""
    host = tensor.cpu() if tensor.is_cuda and dist.get_backend() == "gloo" else tensor
    yield host
    if host is not tensor:
        tensor.copy_(host)


# --- a model to replicate ---
def make_model(seed):
    torch.manual_seed(seed)
    # BatchNorm carries buffers, its running statistics. DDP broadcasts those too, not only weights.
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))


def fingerprint(model):
    """Every parameter and buffer, flattened. Equal fingerprints mean identical replicas."""
    return torch.cat([t.float().flatten() for t in model.state_dict().values()])


def all_identical(vec):
    """True on every rank if vec is bitwise equal on all ranks. Each rank compares with rank 0's."""
    ref = vec.clone()
    dist.broadcast(ref, src=0)
    differs = torch.tensor([0.0 if torch.equal(ref, vec) else 1.0], device=vec.device)
    dist.all_reduce(differs, op=dist.ReduceOp.MAX)  # One answer, the same on every rank.
    return differs.item() == 0


def main(args):
    if WORLD < 2:  # A source and a replica to make identical need two ranks at least.
        raise UsageError("this lesson needs 2 or more ranks, so launch with torchrun, "
                         f"e.g. torchrun --nproc_per_node=2 {sys.argv[0]}")
    device = setup(args)  # RANK and WORLD come from torchrun's environment, as 01 shows.

    # 1. The library's call. Every rank starts with a tensor of its own and ends with --src's.
    t = torch.arange(4, device=device) + 100 * RANK
    log_in_rank_order(f"before dist.broadcast: {t.tolist()}")
    dist.broadcast(t, src=args.src)
    log_in_rank_order(f"after  dist.broadcast: {t.tolist()}")
    assert torch.equal(t, torch.arange(4, device=device) + 100 * args.src)

    # 2. By hand, on a bigger tensor and several dtypes, compared with the library's result.
    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        g = torch.Generator().manual_seed(1234 + RANK)  # A different tensor on every rank.
        mine = (torch.randn(args.numel, generator=g) * 100).to(dtype).to(device)
        ours, lib = mine.clone(), mine.clone()
        rounds = tree_broadcast(ours, src=args.src)
        dist.broadcast(lib, src=args.src)
        assert torch.equal(ours, lib), f"tree_broadcast != dist.broadcast for {dtype}"
    print0(f"tree_broadcast == dist.broadcast ({args.numel:,} elements; float32, int64, bfloat16) "
           f"in ceil(log2 {WORLD}) = {rounds} round(s)")

    # 3. Each rank builds its own model, with its own seed. These replicas differ...
    model = make_model(seed=RANK).to(device)
    with torch.no_grad():
        model[1].running_mean.fill_(RANK)  # As if each rank saw other data, so buffers differ too.
    assert not all_identical(fingerprint(model)), "replicas should differ before the broadcast"
    print0("before: replicas differ (each rank used its own seed)")
    library = fingerprint(model)
    dist.broadcast(library, src=0)  # The library's copy of rank 0's state, to check ours against.
    # ...until rank 0's parameters and buffers are broadcast. DDP's constructor does this. Identical
    # gradients applied to identical weights then keep the replicas identical ever after.
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            tree_broadcast(tensor.data, src=0)  # Always rank 0, as in DDP, whatever --src says.
    assert torch.equal(fingerprint(model), library), "the replicas do not hold rank 0's state"
    print0("after:  replicas identical, with rank 0's parameters and buffers. "
           "DDP always starts from rank 0's weights.")
    print0(f"OK dist.broadcast, tree_broadcast and replica sync checked on {WORLD} ranks")


# --- plumbing the lesson calls: ordered output, flags ---
def log_in_rank_order(line):
    """Every rank's line, printed by rank 0 in rank order. Lines printed by each rank would race."""
    lines = [None] * WORLD
    dist.all_gather_object(lines, line)
    for r, text in enumerate(lines):
        print0(f"[rank {r}/{WORLD}] {text}")


def parse_args():
    p = Parser(__doc__)
    p.add_argument("--src", type=int, default=0, help="the rank that steps 1 and 2 broadcast from")
    p.add_argument("--numel", type=at_least(1), default=100_000,
                   help="elements in the tensors broadcast by hand")
    a = p.parse_args()
    if not 0 <= a.src < WORLD:  # Checked before any process group starts.
        p.error(f"--src {a.src} is not a rank of this job, whose ranks are 0 to {WORLD - 1}")
    return a


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
