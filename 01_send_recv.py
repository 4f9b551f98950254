"""01 - Point-to-point messages: who is who in a job, and the only thing every collective is built from.

What it teaches, in order:
  0. joining a job: the environment variables torchrun gives each process (its rank, the world size, its local
     rank), and dist.init_process_group, the call that makes the processes one group;
  1. who am I: each rank's global rank, local rank, node, world size and device, and the same ranks named as a
     grid (nodes x ranks per node) by a DeviceMesh;
  2. blocking send/recv: rank 0 hands every other rank its own tensor;
  3. non-blocking isend/irecv: every rank sends to rank 0 at once, overlapping the wait with work; checked equal
     to the library's dist.gather;
  4. a token passed around a ring (one hop at a time), then a ring shift where every rank sends and receives at
     once (batch_isend_irecv: posting both sides together is what keeps NCCL from deadlocking).
Break it: --blocking does the ring shift with a blocking send() then recv() on every rank, the classic deadlock,
and ends in one error line after --timeout-s (10 s with --blocking unless given).
Latency and bandwidth per message size: benchmarks/send_recv.py.

Run it (any N >= 2):
  CPU:      torchrun --nproc_per_node=2 01_send_recv.py [--blocking]
  N GPUs:   torchrun --nproc_per_node=N 01_send_recv.py        (nccl, one GPU per rank)
  2 nodes:  torchrun --nnodes=2 --node_rank=K --nproc_per_node=G --master_addr=HOST --master_port=29500 01_send_recv.py
"""

import argparse
import math
import os
import signal
import socket
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


# --- the idea: join the job, then point-to-point messages ---
def join(args):
    """Who this process is, and the call that makes N processes one group. Returns (rank, world size, device).

    02-08 do the same in setup(), in the setup block at the end of each script.
    """
    # torchrun starts this file once per rank; each copy learns who it is from environment variables:
    #   RANK, WORLD_SIZE              its number in the whole job (0 .. WORLD_SIZE-1), and how many there are
    #   LOCAL_RANK, LOCAL_WORLD_SIZE  the same on its own node: the local rank picks the GPU
    #   MASTER_ADDR, MASTER_PORT      where rank 0 keeps the store that every process dials to find the others
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if world < 2:  # plain `python 01_send_recv.py` sets none of them: a job of one has nobody to talk to
        raise UsageError(f"needs 2 or more ranks: launch with torchrun, e.g. torchrun --nproc_per_node=2 {sys.argv[0]}")
    global RANK, WORLD  # what print0 and log (setup block) tag their lines with
    RANK, WORLD = rank, world
    # NCCL on cuda:LOCAL_RANK when this node has a GPU for every local rank, else gloo on the CPU (choose_device, in
    # the setup block, decides and says why). --device cpu never asks CUDA.
    n_gpus = 0 if args.device == "cpu" else torch.cuda.device_count()
    device, backend, note = choose_device(args.device, args.backend, n_gpus, local_rank, local_world)
    if note:
        print0(f"note: {note}")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init, so that NCCL binds this rank to its GPU
    # The first distributed call. It reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from the environment and
    # returns once all WORLD_SIZE processes have called it. Its timeout turns a peer that never comes, or a wait
    # that never ends (see --blocking), into an error instead of a hang.
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout_s))
    return rank, world, device


def who_am_i(rank, world, device):
    """Global rank names a process in the whole job; local rank names it on its node (and picks its GPU)."""
    node = f"{os.environ.get('GROUP_RANK', 0)} ({socket.gethostname()})"  # GROUP_RANK: torchrun's node number
    me = (rank, int(os.environ.get("LOCAL_RANK", 0)), node, world, str(device))
    table = [None] * world
    dist.all_gather_object(table, me)  # every rank's row, on every rank
    print0("| global rank | local rank | node | world size | device |\n|---:|---:|---|---:|---|")
    for row in table:
        print0("| " + " | ".join(map(str, row)) + " |")
    # The same ranks as a grid: one row per node, one column per local rank. Parallelisms beyond data
    # parallel (tensor, pipeline, FSDP's hybrid sharding) are laid out on such a mesh, one dimension each.
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    mesh = init_device_mesh(device.type, (world // per_node, per_node), mesh_dim_names=("node", "local"))
    print0(f"DeviceMesh, dimensions {mesh.mesh_dim_names}: {mesh.mesh.tolist()}")
    log_in_rank_order(f"my (node, local) coordinate in the mesh: {tuple(mesh.get_coordinate())}")


def main(args):
    rank, world, device = join(args)  # 0. join the job
    print0(f"world_size={world} backend={dist.get_backend()} device={device.type} torch={torch.__version__}")
    if args.blocking and dist.get_backend() == "nccl":
        raise UsageError("--blocking shows the deadlock on gloo (add --backend gloo): NCCL's send() blocks the GPU "
                         "stream, not this call, and its watchdog would end the job in an abort, not one line")
    who_am_i(rank, world, device)  # 1. who is who
    if dist.get_backend() == "gloo" and device.type == "cuda":
        # gloo's send/recv read and write host memory only (its CUDA support covers collectives): a CUDA
        # tensor's address would go to the socket as is. So on gloo the messages below live on the CPU.
        print0("note: gloo sends CPU tensors only: the messages below are staged on the CPU (nccl sends GPU memory)")
        device = torch.device("cpu")

    # 2. Blocking: each call returns only when the message is handed over, so the order of calls matters.
    if rank == 0:
        for dst in range(1, world):
            dist.send(torch.full((4,), float(dst), device=device), dst=dst)
        got = None
    else:
        got = torch.empty(4, device=device)
        dist.recv(got, src=0)
        assert torch.equal(got, torch.full((4,), float(rank), device=device))
    log_in_rank_order("send/recv: sent a tensor to every other rank" if rank == 0 else
                      f"send/recv: got {got.tolist()} from rank 0")

    # 3. Non-blocking: isend/irecv return a handle at once; we can compute while the bytes travel.
    mine = torch.tensor([rank * 10.0, rank * 10.0 + 1], device=device)
    if rank == 0:
        inbox = [torch.empty(2, device=device) for _ in range(world - 1)]
        handles = [dist.irecv(inbox[r - 1], src=r) for r in range(1, world)]
        torch.randn(256, 256, device=device).matmul(torch.randn(256, 256, device=device))  # work done meanwhile
        for h in handles:
            h.wait()  # only now may we read inbox
        gathered = [mine] + inbox
    else:
        dist.isend(mine, dst=0).wait()  # the buffer must not change until wait() returns
    library = [torch.empty(2, device=device) for _ in range(world)] if rank == 0 else None
    dist.gather(mine, gather_list=library, dst=0)  # the library call our isend/irecv replaced
    if rank == 0:
        assert all(torch.equal(a, b) for a, b in zip(gathered, library)), "hand-written gather != dist.gather"
        print0(f"isend/irecv gather: {[t.tolist() for t in gathered]} == dist.gather")

    # 4a. A token around the ring, one hop at a time: rank r receives from r-1, adds r, sends to r+1.
    right, left = (rank + 1) % world, (rank - 1) % world
    token = torch.zeros(1, device=device)
    if rank == 0:
        dist.send(token, dst=right)  # rank 0 starts the ring; everybody else waits for the token first
        dist.recv(token, src=left)
        assert token.item() == sum(range(world)), token
        print0(f"token ring: came back as {token.item():.0f} = 0+1+...+{world - 1}")
    else:
        dist.recv(token, src=left)
        token += rank
        dist.send(token, dst=right)

    # 4b. A ring shift: everyone sends right and receives from the left at the same time.
    send, recv = torch.full((3,), float(rank), device=device), torch.empty(3, device=device)
    if args.blocking:
        # Break it. A blocking send returns only once the receiver has posted the matching recv; here every
        # receiver is itself stuck in its own send(), so no rank ever reaches recv(): each waits on the next,
        # all the way round. Only the group's timeout ends it.
        print0(f"ring shift, --blocking: every rank calls send() to its right, then recv() from its left (the group "
               f"gives up after --timeout-s {args.timeout_s:g} s)")
        try:
            dist.send(send, dst=right)
            dist.recv(recv, src=left)
        except RuntimeError:  # gloo: "Timed out waiting ... for send operation to complete"
            deadlocked(args.timeout_s)
    else:
        # Batching both sides lets the backend match them (on NCCL this is one fused group call).
        ops = [dist.P2POp(dist.isend, send, right), dist.P2POp(dist.irecv, recv, left)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    assert torch.equal(recv, torch.full((3,), float(left), device=device))
    log_in_rank_order(f"ring shift: got {recv[0].item():.0f} from rank {left}")

    # Every rank reports in, so the OK below speaks for all of them.
    done = torch.ones(1, device=device)
    dist.all_reduce(done)
    assert done.item() == world
    print0(f"OK send/recv, isend/irecv, token ring and ring shift checked on {world} ranks")


# --- plumbing the lesson calls: ordered output, the deadlock's message, flags ---
def log_in_rank_order(line):
    """Every rank's line, printed by rank 0 in rank order: lines that each rank prints itself race each other."""
    lines = [None] * WORLD
    dist.all_gather_object(lines, line)
    for r, text in enumerate(lines):
        print0(f"[rank {r}/{WORLD}] {text}")


def deadlocked(timeout_s):
    """--blocking's end: one line from rank 0, exit 1 on every rank, no teardown (the sends are still posted)."""
    if RANK == 0:
        print(f"error: deadlock: every rank sat in a blocking send() to its right neighbour, waiting for a recv() "
              f"that nobody posted (each receiver was stuck in its own send()), so nothing moved for {timeout_s:g} s "
              f"(--timeout-s); post both sides at once with batch_isend_irecv, as the run without --blocking does",
              file=sys.stderr, flush=True)
    else:
        time.sleep(1)  # every rank timed out at about the same moment: let rank 0 say why before the job stops
    os._exit(1)


def parse_args():
    p = parser(__doc__)
    p.add_argument("--blocking", action="store_true",
                   help="break it: the ring shift on blocking send() then recv() on every rank, a deadlock ended by "
                        "--timeout-s (10 s with this flag unless given)")
    args = p.parse_args()
    if args.blocking and args.timeout_s == p.get_default("timeout_s"):
        args.timeout_s = 10.0  # the deadlock lasts until the group's timeout: short, so that the lesson ends soon
    return args


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
