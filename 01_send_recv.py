"""01 - Joining a job, and point-to-point messages: who is who, and what every collective is built from.

What it teaches, in order:
  1. joining: torchrun starts this file once per rank and tells each copy who it is in environment variables;
     setup() picks the rank's device and makes the copies one group (later scripts end with this same setup());
  2. blocking send/recv: rank 0 hands every other rank its own tensor;
  3. non-blocking isend/irecv: every rank sends to rank 0 at once; checked equal to the library's dist.gather;
  4. a ring shift where every rank sends and receives at once, then a token around the ring, one hop at a time.
Break it: --blocking, the ring shift on blocking send() then recv(): a deadlock. Timings: benchmarks/send_recv.py.

Run it (any N >= 2):
  CPU:      torchrun --nproc_per_node=2 01_send_recv.py [--blocking]
  N GPUs:   torchrun --nproc_per_node=N 01_send_recv.py        (nccl, one GPU per rank)
  2 nodes:  torchrun --nnodes=2 --node_rank=K --nproc_per_node=G --master_addr=HOST --master_port=29500 01_send_recv.py
"""

import argparse
import math
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

# What torchrun puts in each process's environment (the setup block at the end reads RANK and WORLD from them):
#   RANK, WORLD_SIZE              its number in the whole job (0 .. WORLD_SIZE-1), and how many processes there are
#   LOCAL_RANK, LOCAL_WORLD_SIZE  the same on its own node (the local rank picks the GPU)
#   GROUP_RANK                    the node's number (0 .. nodes-1): --node_rank on the torchrun command line
#   MASTER_ADDR, MASTER_PORT      where rank 0 keeps the store that every process dials to find the others
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# --- the idea: join the job, then point-to-point messages ---
def setup(args):
    """1. Join: choose this rank's device, then make the processes one group. Returns the device."""
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    # The device rule. NCCL, the GPU backend, drives one GPU per rank: with a GPU for each rank on this node, local
    # rank r takes GPU r. With fewer, the CPU and gloo; --device cuda shares the GPUs (gloo can do that, NCCL cannot).
    gpus = 0 if args.device == "cpu" else torch.cuda.device_count()  # --device cpu never asks CUDA
    backend = args.backend or ("nccl" if gpus >= local_world else "gloo")
    if (args.device == "cuda" and gpus == 0) or (backend == "nccl" and gpus < local_world):
        raise UsageError(f"--backend {backend}: {gpus} CUDA GPU(s) for {local_world} ranks")
    device = torch.device(f"cuda:{local_rank % gpus}" if gpus >= local_world or args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init, so that NCCL binds this rank to its GPU
    print0(f"device: {device.type}, {backend} (--device {args.device}, {gpus} GPU(s) for {local_world} ranks/node)")
    # Every rank dials MASTER_ADDR:MASTER_PORT, learns where the others are, and returns once all WORLD_SIZE ranks
    # have arrived. The timeout bounds every later wait on a peer: a dead peer ends the job instead of hanging it.
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout_s))
    return device


def log(*msg):  # a line from this rank, tagged, in one write: the ranks print at once, their lines in any order
    print(f"[rank {RANK}/{WORLD}] " + " ".join(map(str, msg)) + "\n", end="", flush=True)


def who_am_i(device):
    """This rank's torchrun variables and device, in a line of its own (the ranks' lines come in any order)."""
    log(" ".join(f"{name}={os.environ.get(name, '-')}" for name in TORCHRUN_VARS), f"device={device}")
    assert (dist.get_rank(), dist.get_world_size()) == (RANK, WORLD)  # init_process_group read them from there


def main(args):
    if WORLD < 2:  # plain `python 01_send_recv.py` sets none of torchrun's variables: nobody to talk to
        raise UsageError(f"needs 2 or more ranks: launch with torchrun, e.g. torchrun --nproc_per_node=2 {sys.argv[0]}")
    device = setup(args)
    if args.blocking and dist.get_backend() == "nccl":  # NCCL's send() blocks the GPU stream, not this call
        raise UsageError("--blocking shows the deadlock on gloo: add --backend gloo")
    who_am_i(device)
    if dist.get_backend() == "gloo" and device.type == "cuda":  # gloo's send/recv move host memory only
        print0("note: gloo sends CPU tensors only: the messages below are staged on the CPU (nccl sends GPU memory)")
        device = torch.device("cpu")

    # 2. Blocking: each call returns only when the message is handed over, so the order of calls matters.
    if RANK == 0:
        for dst in range(1, WORLD):
            dist.send(torch.full((4,), float(dst), device=device), dst=dst)
        log("send/recv: sent a tensor to every other rank")
    else:
        got = torch.empty(4, device=device)
        dist.recv(got, src=0)
        assert torch.equal(got, torch.full((4,), float(RANK), device=device))
        log(f"send/recv: got {got.tolist()} from rank 0")

    # 3. Non-blocking: isend/irecv return a handle at once; we can compute while the bytes travel.
    mine = torch.tensor([RANK * 10.0, RANK * 10.0 + 1], device=device)
    if RANK == 0:
        inbox = [mine] + [torch.empty(2, device=device) for _ in range(1, WORLD)]
        handles = [dist.irecv(inbox[r], src=r) for r in range(1, WORLD)]
        torch.randn(256, 256, device=device).matmul(torch.randn(256, 256, device=device))  # work done meanwhile
        for h in handles:
            h.wait()  # only now may we read inbox
    else:
        dist.isend(mine, dst=0).wait()  # the buffer must not change until wait() returns
    library = [torch.empty(2, device=device) for _ in range(WORLD)] if RANK == 0 else None
    dist.gather(mine, gather_list=library, dst=0)  # the library call our isend/irecv replaced: the first collective
    if RANK == 0:
        assert all(torch.equal(a, b) for a, b in zip(inbox, library)), "hand-written gather != dist.gather"
        print0(f"isend/irecv gather: {[t.tolist() for t in inbox]} == dist.gather")

    # 4a. A ring shift: every rank sends to its right and receives from its left at the same time.
    right, left = (RANK + 1) % WORLD, (RANK - 1) % WORLD
    send, recv = torch.full((3,), float(RANK), device=device), torch.empty(3, device=device)
    if args.blocking:
        # Break it. A blocking send returns only once the receiver has posted its recv, but every receiver sits in
        # its own send(): no rank reaches recv(), each waits on the next, all the way round, until the timeout.
        print0("ring shift, --blocking: send() to the right, then recv() from the left, on every rank ...")
        try:
            dist.send(send, dst=right)
            dist.recv(recv, src=left)
        except RuntimeError:  # gloo: "Timed out waiting ... for send operation to complete", on every rank at once
            print0(f"error: deadlock: every rank sat in a blocking send() to its right, waiting for a recv() that "
                   f"nobody posted (each receiver sat in its own send()), so nothing moved for {args.timeout_s:g} s "
                   "(--timeout-s); post both sides at once with batch_isend_irecv")
            time.sleep(1)  # let rank 0's line out before torchrun stops the job
            os._exit(1)  # no teardown: the sends are still posted
    else:  # batching both sides lets the backend match them (on NCCL this is one fused group call)
        ops = [dist.P2POp(dist.isend, send, right), dist.P2POp(dist.irecv, recv, left)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    assert torch.equal(recv, torch.full((3,), float(left), device=device))
    log(f"ring shift: got {recv[0].item():.0f} from rank {left}")

    # 4b. A token around the ring, one hop at a time: rank r receives from r-1, adds r, sends to r+1. A rank that
    # failed a check never passes it on: a token back on rank 0 means that the OK below speaks for every rank.
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
    print0(f"OK send/recv, isend/irecv, ring shift and token ring checked on {WORLD} ranks")


# --- plumbing the lesson calls: flags ---
def parse_args():
    p = Parser(__doc__)
    p.add_argument("--blocking", action="store_true", help="break it: the ring shift on blocking send() then "
                   "recv() on every rank, a deadlock ended by --timeout-s (10 s with this flag unless given)")
    args = p.parse_args()
    if args.blocking and args.timeout_s == p.get_default("timeout_s"):
        args.timeout_s = 10.0  # the deadlock lasts until the group's timeout: short, so that the lesson ends soon
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
