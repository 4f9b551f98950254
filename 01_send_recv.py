"""01 - Point-to-point messages: who is who in a job, and the only thing every collective is built from.

What it teaches, in order:
  0. who am I: each rank's global rank, local rank, node, world size and device, and the same ranks named as a
     grid (nodes x ranks per node) by a DeviceMesh;
  1. blocking send/recv: rank 0 hands every other rank its own tensor;
  2. non-blocking isend/irecv: every rank sends to rank 0 at once, overlapping the wait with work; checked equal
     to the library's dist.gather;
  3. a token passed around a ring (one hop at a time), then a ring shift where every rank sends and receives at
     once (batch_isend_irecv: posting both sides together is what keeps NCCL from deadlocking).
Latency and bandwidth per message size: benchmarks/send_recv.py.

Run it (any N >= 2):
  CPU:      torchrun --nproc_per_node=2 01_send_recv.py
  N GPUs:   torchrun --nproc_per_node=N 01_send_recv.py        (nccl, one GPU per rank)
  2 nodes:  torchrun --nnodes=2 --node_rank=K --nproc_per_node=G --master_addr=HOST --master_port=29500 01_send_recv.py
"""

import argparse
import math
import os
import socket
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


# --- the idea: point-to-point messages ---
def who_am_i(device):
    """Global rank names a process in the whole job; local rank names it on its node (and picks its GPU)."""
    me = (RANK, int(os.environ.get("LOCAL_RANK", 0)), f"{os.environ.get('GROUP_RANK', 0)} ({socket.gethostname()})",
          WORLD, str(device))
    table = [None] * WORLD
    dist.all_gather_object(table, me)  # every rank's row, on every rank
    print0("| global rank | local rank | node | world size | device |\n|---:|---:|---|---:|---|")
    for row in table:
        print0("| " + " | ".join(map(str, row)) + " |")
    # The same ranks as a grid: one row per node, one column per local rank. Parallelisms beyond data
    # parallel (tensor, pipeline, FSDP's hybrid sharding) are laid out on such a mesh, one dimension each.
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", WORLD))
    mesh = init_device_mesh(device.type, (WORLD // per_node, per_node), mesh_dim_names=("node", "local"))
    print0(f"DeviceMesh, dimensions {mesh.mesh_dim_names}: {mesh.mesh.tolist()}")
    log(f"my (node, local) coordinate in the mesh: {tuple(mesh.get_coordinate())}")


def main(args):
    device = setup(args)
    print0(f"world_size={WORLD} backend={dist.get_backend()} device={device.type} torch={torch.__version__}")
    who_am_i(device)
    if dist.get_backend() == "gloo" and device.type == "cuda":
        # gloo's send/recv read and write host memory only (its CUDA support covers collectives): a CUDA
        # tensor's address would go to the socket as is. So on gloo the messages below live on the CPU.
        print0("note: gloo sends CPU tensors only: the messages below are staged on the CPU (nccl sends GPU memory)")
        device = torch.device("cpu")

    # 1. Blocking: each call returns only when the message is handed over, so the order of calls matters.
    if RANK == 0:
        for dst in range(1, WORLD):
            dist.send(torch.full((4,), float(dst), device=device), dst=dst)
    else:
        got = torch.empty(4, device=device)
        dist.recv(got, src=0)
        assert torch.equal(got, torch.full((4,), float(RANK), device=device))
        log(f"send/recv: got {got.tolist()} from rank 0")

    # 2. Non-blocking: isend/irecv return a handle at once; we can compute while the bytes travel.
    mine = torch.tensor([RANK * 10.0, RANK * 10.0 + 1], device=device)
    if RANK == 0:
        inbox = [torch.empty(2, device=device) for _ in range(WORLD - 1)]
        handles = [dist.irecv(inbox[r - 1], src=r) for r in range(1, WORLD)]
        torch.randn(256, 256, device=device).matmul(torch.randn(256, 256, device=device))  # work done meanwhile
        for h in handles:
            h.wait()  # only now may we read inbox
        gathered = [mine] + inbox
    else:
        dist.isend(mine, dst=0).wait()  # the buffer must not change until wait() returns
    library = [torch.empty(2, device=device) for _ in range(WORLD)] if RANK == 0 else None
    dist.gather(mine, gather_list=library, dst=0)  # the library call our isend/irecv replaced
    if RANK == 0:
        assert all(torch.equal(a, b) for a, b in zip(gathered, library)), "hand-written gather != dist.gather"
        print0(f"isend/irecv gather: {[t.tolist() for t in gathered]} == dist.gather")

    # 3a. A token around the ring, one hop at a time: rank r receives from r-1, adds r, sends to r+1.
    right, left = (RANK + 1) % WORLD, (RANK - 1) % WORLD
    token = torch.zeros(1, device=device)
    if RANK == 0:
        dist.send(token, dst=right)  # rank 0 starts the ring; everybody else waits for the token first
        dist.recv(token, src=left)
        assert token.item() == sum(range(WORLD)), token
        print0(f"token ring: came back as {token.item():.0f} = 0+1+...+{WORLD - 1}")
    else:
        dist.recv(token, src=left)
        token += RANK
        dist.send(token, dst=right)

    # 3b. A ring shift: everyone sends right and receives from the left at the same time. With blocking
    # calls every rank would sit in send() waiting for a recv() nobody has posted yet; batching both
    # sides lets the backend match them (on NCCL this is one fused group call).
    send, recv = torch.full((3,), float(RANK), device=device), torch.empty(3, device=device)
    ops = [dist.P2POp(dist.isend, send, right), dist.P2POp(dist.irecv, recv, left)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    assert torch.equal(recv, torch.full((3,), float(left), device=device))
    log(f"ring shift: got {recv[0].item():.0f} from rank {left}")

    # Every rank reports in, so the OK below speaks for all of them.
    done = torch.ones(1, device=device)
    dist.all_reduce(done)
    assert done.item() == WORLD
    print0(f"OK send/recv, isend/irecv, token ring and ring shift checked on {WORLD} ranks")


def parse_args():
    return parser(__doc__).parse_args()


# --- distributed setup: the same block in every numbered script, copied (not imported) so each file runs alone ---
RANK, WORLD = 0, 1


class UsageError(Exception):
    """Bad input: one line on rank 0 (`error: ...`), exit status 2, no traceback."""


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
    """Bad input: one line on rank 0, exit 2. A peer that died or timed out: one line per survivor, exit 1."""
    code = 0
    try:
        main(parse_args())
    except UsageError as e:
        if os.environ.get("RANK", "0") == "0":  # every rank stops alike; one says why
            print(f"error: {e}", file=sys.stderr, flush=True)
        code = 2
    except RuntimeError as e:  # NCCL raises DistError; gloo, RuntimeErrors from torch.distributed or its transport
        where, text = traceback.extract_tb(e.__traceback__)[-1].filename, str(e)
        if not (isinstance(e, dist.DistError) or f"torch{os.sep}distributed" in where or "gloo/" in text):
            raise  # a bug in this rank's own code keeps its traceback
        what = "timed out waiting for a peer" if "timed out" in text.lower() else "lost a peer"
        log(f"error: {what} ({text.strip().splitlines()[0][:160]})")
        os._exit(1)  # no teardown: it would wait for the dead peer
    if dist.is_initialized():
        dist.destroy_process_group()
        # gloo's threads may still hold the last reference to a finished collective; freeing it takes the GIL,
        # which no thread gets once the interpreter is finalising ("terminate called without an active
        # exception", SIGABRT). A moment here lets them finish first.
        time.sleep(0.05)
    sys.exit(code)


if __name__ == "__main__":
    run(main, parse_args)
