"""02 - Broadcast: one rank's tensor on every rank, and why DDP starts with one.

What it teaches, in order:
  1. dist.broadcast from a chosen --src;
  2. the same thing by hand on send/recv: a binomial tree that doubles the number of ranks holding the
     data every round, so N ranks need ceil(log2 N) rounds instead of N-1 sends from the source;
     checked equal to dist.broadcast;
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
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

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


# --- the idea: a binomial-tree broadcast on point-to-point messages ---
def tree_broadcast(tensor, src=0):
    """Overwrite ``tensor`` on every rank with ``src``'s copy, in place. Returns the number of rounds.

    Ranks are renumbered relative to the source (vrank 0 = src). In round k the 2**k ranks that already
    hold the data (vranks < 2**k) each send it to vrank + 2**k. Within a round every rank is in at most
    one pair, so blocking send/recv cannot deadlock, on gloo or NCCL.
    """
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
    device = setup(args)
    print0(f"world_size={WORLD} backend={dist.get_backend()} device={device.type} src={args.src}")

    # 1. The library call: only src's values matter; the other ranks' tensors are overwritten.
    t = torch.arange(4, device=device, dtype=torch.float32) + (100 * args.src if RANK == args.src else -1)
    dist.broadcast(t, src=args.src)
    log(f"dist.broadcast: {t.tolist()}")

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
    dist.barrier()
    print0(f"OK dist.broadcast, tree_broadcast and replica sync checked on {WORLD} ranks")
    teardown()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--src", type=int, default=0, help="rank whose tensor is broadcast")
    p.add_argument("--numel", type=int, default=100_000, help="elements in the tensors broadcast by hand")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda if available")
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None, help="default: nccl on cuda, gloo on cpu")
    p.add_argument("--timeout-s", type=float, default=120, help="process-group timeout: a dead peer fails, not hangs")
    a = p.parse_args()
    if a.numel < 1 or a.timeout_s <= 0:
        p.error("--numel must be >= 1 and --timeout-s > 0")
    if not 0 <= a.src < int(os.environ.get("WORLD_SIZE", a.src + 1)):  # checked before any process group starts
        p.error(f"--src {a.src} is not a rank: WORLD_SIZE={os.environ.get('WORLD_SIZE')}")
    main(a)
