"""02 - Broadcast: one rank's tensor on every rank, and why DDP starts with one.

What it teaches, in order:
  1. dist.broadcast from a chosen --src: each rank's tensor before and after;
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
import signal
import sys
import time
import traceback
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


def check_memory(nbytes, what, device):
    """One line before the work if `what` cannot fit: `nbytes`, a lower bound of what it needs, against this rank's
    share of its device's free memory (a node's RAM and a shared GPU are split between their ranks)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if device.type == "cuda":
        free, sharing = torch.cuda.mem_get_info(device)[0], -(-local_world // torch.cuda.device_count())
    else:
        free, sharing = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), local_world
        if os.path.exists("/proc/meminfo"):  # Linux says what is available: free, and cache it can drop
            with open("/proc/meminfo") as f:
                free = next((int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:")), free)
    share = torch.tensor([free / sharing], dtype=torch.float64, device=device)
    dist.all_reduce(share, op=dist.ReduceOp.MIN)  # the smallest share decides, so every rank decides alike
    if nbytes > share.item():
        raise UsageError(f"{what} would need at least {nbytes / 2**30:,.1f} GiB, more than this rank's share of "
                         f"{device.type} memory ({share.item() / 2**30:,.1f} GiB)")


def main(args):
    device = setup(args)  # RANK and WORLD come from torchrun's environment, read there as 01 shows
    print0(f"world_size={WORLD} backend={dist.get_backend()} device={device.type} src={args.src}")
    check_memory(3 * 8 * args.numel, f"--numel {args.numel:,}", device)  # three copies, int64 the largest

    # 1. The library call. Every rank starts with a tensor of its own; afterwards every rank holds src's, and
    # what the others held is gone (overwritten in place).
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
    p = parser(__doc__)
    p.add_argument("--src", type=int, default=0, help="rank whose tensor is broadcast")
    p.add_argument("--numel", type=number(int, 1), default=100_000, help="elements in the tensors broadcast by hand")
    a = p.parse_args()
    if not 0 <= a.src < int(os.environ.get("WORLD_SIZE", a.src + 1)):  # checked before any process group starts
        p.error(f"--src {a.src} is not a rank: WORLD_SIZE={os.environ.get('WORLD_SIZE')}")
    return a


# --- distributed setup: the same block in every numbered script, copied (not imported) so each file runs alone ---
RANK, WORLD = 0, 1


class UsageError(Exception):
    """Bad input: one line on rank 0 (`error: ...`), exit status 2, no traceback."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM, raised in the main thread, so the run unwinds through its own cleanup (nothing is
    left half-written). Code that knows where the run stopped sets `where` for run()'s one line."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.where = signum, ""


def print0(*msg):  # the rank-0 narrative: printed once, not N times
    if RANK == 0:
        print(*msg, flush=True)


def log(*msg):  # a per-rank line, tagged, in one write so that lines of different ranks never mix
    sys.stdout.write(f"[rank {RANK}/{WORLD}] " + " ".join(map(str, msg)) + "\n")
    sys.stdout.flush()


def number(kind, low, high=math.inf, above=False):
    """The argparse type of every numeric flag: a finite int or float from `low` (or above it) to `high`."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not (math.isfinite(value) and (value > low if above else value >= low) and value <= high):
            bound = f"{'>' if above else '>='} {low}" + (f" and <= {high}" if high < math.inf else "")
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value
    return parse


def parser(doc, timeout_s=120):
    """argparse with the flags every script shares; a bad flag is one line on rank 0, not a usage text per rank."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)

    def error(message):
        raise UsageError(message)
    p.error = error
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA if GPUs >= ranks")
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None, help="default: nccl if every rank has a GPU")
    p.add_argument("--timeout-s", type=number(float, 1, 30 * 86400), default=timeout_s,
                   help="how long a rank waits for a dead or stuck peer")
    return p


def choose_device(device, backend, n_gpus, local_rank, local_world):
    """(device, backend, note) from the flags and this node's GPUs. NCCL needs a GPU per rank; gloo shares."""
    if device == "cpu" or (device == "auto" and n_gpus == 0):
        if backend == "nccl":
            raise UsageError("--backend nccl runs on CUDA GPUs only: use gloo on the CPU")
        return torch.device("cpu"), "gloo", None
    if n_gpus == 0:
        raise UsageError("--device cuda, but this node has no CUDA GPU: use --device cpu")
    if n_gpus >= local_world:  # the usual GPU setup: local rank r takes cuda:r
        return torch.device("cuda", local_rank), backend or "nccl", None
    fix = f"start --nproc_per_node={n_gpus}, or share the GPU(s) over gloo with --device cuda --backend gloo"
    if backend == "nccl":
        raise UsageError(f"nccl needs one GPU per rank, but this node has {n_gpus} for {local_world} ranks: {fix}")
    if device == "auto":
        return torch.device("cpu"), "gloo", f"{n_gpus} GPU(s) for {local_world} ranks here, so CPU and gloo; {fix}"
    return torch.device("cuda", local_rank % n_gpus), "gloo", f"{local_world} ranks share {n_gpus} GPU(s) over gloo"


def setup(args, min_world=2):
    """Choose the device, then join the process group. Global RANK names a process; LOCAL_RANK picks its GPU."""
    global RANK, WORLD
    RANK, WORLD = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if WORLD < min_world:
        raise UsageError(f"needs {min_world} or more ranks: launch with torchrun, e.g. torchrun "
                         f"--nproc_per_node={min_world} {sys.argv[0]}")
    n_gpus = 0 if args.device == "cpu" else torch.cuda.device_count()  # --device cpu never touches CUDA
    device, backend, note = choose_device(args.device, args.backend, n_gpus, int(os.environ.get("LOCAL_RANK", 0)),
                                          int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if note:
        print0(f"note: {note}")
    if device.type == "cuda":  # before init, so NCCL binds this rank to its GPU (not device_id=: pytorch#153960)
        torch.cuda.set_device(device)
    # Plain `python` (no torchrun): a group of one, in memory, so the same code runs. The timeout turns a dead peer
    # into an error after --timeout-s instead of a silent 30-minute hang.
    alone = {} if "RANK" in os.environ else dict(store=dist.HashStore(), rank=0, world_size=1)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout_s), **alone)
    return device


def run(main, parse_args):
    """Bad input: one line on rank 0, exit 2. A peer that died or timed out: one line per survivor, exit 1.
    Ctrl-C or SIGTERM: one line on rank 0, and the process ends by that signal, as a shell expects (130, 143)."""
    # SIGTERM (a scheduler's, or torchrun passing on the Ctrl-C it got) stops a run the way Ctrl-C does.
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    code = 0
    try:  # the outer try: a signal may land anywhere, even while the inner one reports a lost peer
        try:
            main(parse_args())
        except UsageError as e:
            if os.environ.get("RANK", "0") == "0":  # every rank stops alike; one says why
                print(f"error: {e}", file=sys.stderr, flush=True)
            code = 2
        except RuntimeError as e:  # NCCL raises DistError; gloo, RuntimeErrors from torch.distributed or its transport
            where, text = traceback.extract_tb(e.__traceback__)[-1].filename, str(e)
            if signalled(e) or not (isinstance(e, dist.DistError) or f"torch{os.sep}distributed" in where
                                    or "gloo/" in text):
                raise  # a bug in this rank's own code keeps its traceback; a signal goes to the outer try
            what = "timed out waiting for a peer" if "timed out" in text.lower() else "lost a peer"
            log(f"error: {what} ({text.strip().splitlines()[0][:160]})")
            os._exit(1)  # no teardown: it would wait for the dead peer
        if dist.is_initialized():
            dist.destroy_process_group()
            # gloo's threads may still hold the last reference to a finished collective; freeing it takes the GIL,
            # which no thread gets once the interpreter is finalising ("terminate called without an active
            # exception", SIGABRT). A moment here lets them finish first.
            time.sleep(0.05)
    except BaseException as e:
        stop = signalled(e)
        if stop is None:
            raise
        if os.environ.get("RANK", "0") == "0":  # every rank got the signal (torchrun passes it on); one says where
            where = f" {stop.where}" if stop.where else ""
            print(f"interrupted by {stop}{where}", file=sys.stderr, flush=True)
        end_by_signal(stop.signum)  # no teardown: the peers are stopping too
    sys.exit(code)


def signalled(e):
    """The Interrupted behind exception `e`, or None. A signal that lands inside a library can come back as that
    library's own error, raised while handling it (torch.save's "unexpected pos" when its write was cut short)."""
    while e is not None and not isinstance(e, Interrupted):
        e = e.__context__
    return e


def interrupt(signum, frame):
    # Only the first signal: a second Ctrl-C must not cut the way out (cleanup, the one line) short with a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Interrupted(signum)


def end_by_signal(signum):
    """End this process as the signal would have: its parent (a shell, torchrun) sees an interrupt, not a failure."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


if __name__ == "__main__":
    run(main, parse_args)
