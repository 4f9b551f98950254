"""02 - Broadcast: one rank's tensor on every rank, and why DDP starts with one.

What it teaches, in order:
  1. dist.broadcast from a chosen --src: each rank's tensor before and after;
  2. the same thing by hand on send/recv: a binomial tree that doubles the ranks holding the data every round,
     so N ranks need ceil(log2 N) rounds instead of N-1 sends from the source; checked equal to dist.broadcast;
  3. why DDP broadcasts at start-up: replicas built with different seeds differ, and broadcasting rank 0's
     parameters and buffers makes them identical (checked on every rank).

Run it (any N >= 2):
  CPU:      torchrun --nproc_per_node=2 02_broadcast.py [--src 1]
  N GPUs:   torchrun --nproc_per_node=N 02_broadcast.py        (nccl, one GPU per rank)
  2 nodes:  torchrun --nnodes=2 --node_rank=K --nproc_per_node=G --master_addr=HOST --master_port=29500 02_broadcast.py
"""

import argparse
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
    """Overwrite ``tensor`` on every rank with ``src``'s copy, in place. Returns the number of rounds.

    Ranks are renumbered relative to the source (vrank 0 = src). In round k the 2**k ranks that already
    hold the data (vranks < 2**k) each send it to vrank + 2**k. Within a round every rank is in at most
    one pair, so blocking send/recv cannot deadlock, on gloo or NCCL.
    """
    if tensor.is_cuda and dist.get_backend() == "gloo":
        # gloo's send/recv move host memory only (its CUDA support covers collectives): go through a CPU copy.
        host = tensor.cpu()
        rounds = tree_broadcast(host, src)
        tensor.copy_(host)
        return rounds
    rank, world = dist.get_rank(), dist.get_world_size()
    vrank = (rank - src) % world
    rounds = math.ceil(math.log2(world)) if world > 1 else 0
    for k in range(rounds):
        step = 1 << k
        if vrank < step and vrank + step < world:
            dist.send(tensor, dst=(vrank + step + src) % world)
        elif step <= vrank < 2 * step:
            dist.recv(tensor, src=(vrank - step + src) % world)
    return rounds


# --- a model to replicate ---
def make_model(seed):
    torch.manual_seed(seed)
    # BatchNorm carries buffers (running stats): DDP must broadcast those too, not only parameters.
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))


def fingerprint(model):
    """Every parameter and buffer, flattened: equal fingerprints mean identical replicas."""
    return torch.cat([t.detach().float().flatten() for t in list(model.parameters()) + list(model.buffers())])


def all_identical(vec):
    """True on every rank iff ``vec`` is bitwise equal on all ranks (each rank compares with rank 0's)."""
    ref = vec.clone()
    dist.broadcast(ref, src=0)
    differs = torch.tensor([0.0 if torch.equal(ref, vec) else 1.0], device=vec.device)
    dist.all_reduce(differs, op=dist.ReduceOp.MAX)  # one answer everyone agrees on
    return differs.item() == 0


def main(args):
    if WORLD < 2:  # replicas to make identical, and a source to broadcast from, need two ranks at least
        raise UsageError(f"needs 2 or more ranks: launch with torchrun, e.g. torchrun --nproc_per_node=2 {sys.argv[0]}")
    device = setup(args)  # RANK and WORLD come from torchrun's environment (01 shows them)

    # 1. The library call. Every rank starts with a tensor of its own and ends with --src's, in place.
    t = torch.arange(4, device=device) + 100 * RANK
    log_in_rank_order(f"before dist.broadcast: {t.tolist()}")
    dist.broadcast(t, src=args.src)
    log_in_rank_order(f"after  dist.broadcast: {t.tolist()}")
    assert torch.equal(t, torch.arange(4, device=device) + 100 * args.src)

    # 2. By hand, on a bigger tensor and several dtypes, compared with the library's result.
    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        g = torch.Generator().manual_seed(1234 + RANK)  # a different tensor on every rank
        mine = (torch.randn(args.numel, generator=g) * 100).to(dtype).to(device)
        ours, lib = mine.clone(), mine.clone()
        rounds = tree_broadcast(ours, src=args.src)
        dist.broadcast(lib, src=args.src)
        assert torch.equal(ours, lib), f"tree_broadcast != dist.broadcast for {dtype}"
    print0(f"tree_broadcast == dist.broadcast ({args.numel:,} elements; float32, int64, bfloat16) "
           f"in ceil(log2 {WORLD}) = {rounds} round(s)")

    # 3. Replicas with different seeds (as if each rank initialised its own model) are not identical...
    model = make_model(seed=RANK).to(device)
    with torch.no_grad():
        model[1].running_mean.fill_(RANK)  # pretend each rank saw different data: buffers differ too
    assert not all_identical(fingerprint(model)), "replicas should differ before the broadcast"
    print0("before: replicas differ (each rank used its own seed)")
    # ...until rank 0's parameters and buffers are broadcast. This is what DDP's constructor does, so that
    # identical gradients applied to identical weights keep the replicas identical forever after.
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            tree_broadcast(tensor.data, src=0)
    assert all_identical(fingerprint(model)), "replicas differ after broadcasting rank 0's state"
    print0("after:  replicas identical (rank 0's parameters and buffers broadcast)")
    print0(f"OK dist.broadcast, tree_broadcast and replica sync checked on {WORLD} ranks")


# --- plumbing the lesson calls: ordered output, flags ---
def log_in_rank_order(line):
    """Every rank's line, printed by rank 0 in rank order: lines that each rank prints itself race each other."""
    lines = [None] * WORLD
    dist.all_gather_object(lines, line)
    for r, text in enumerate(lines):
        print0(f"[rank {r}/{WORLD}] {text}")


def parse_args():
    p = Parser(__doc__)
    p.add_argument("--src", type=int, default=0, help="rank whose tensor is broadcast")
    p.add_argument("--numel", type=at_least(1), default=100_000, help="elements in the tensors broadcast by hand")
    a = p.parse_args()
    if not 0 <= a.src < WORLD:  # checked before any process group starts
        p.error(f"--src {a.src} is not a rank: WORLD_SIZE={WORLD}")
    return a


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
