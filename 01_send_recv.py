"""01 - Joining a job, and messages between two ranks. Every collective is built from these.

It teaches four things, in this order.
  1. Joining. torchrun starts this file once per rank, and tells each copy who it is in environment
     variables. setup() picks the rank's device and joins the copies into one group.
  2. Blocking send and recv. Rank 0 hands every other rank a tensor of its own.
  3. Non-blocking isend and irecv. Every rank sends to rank 0 at once, as dist.gather does.
  4. A ring. Every rank sends and receives at the same time. Then a token goes round, hop by hop.
To break it, add --blocking. The ring then runs on blocking send() and recv(), and deadlocks.

Run it on the CPU with 2 ranks or more, or on N GPUs:
  torchrun --nproc_per_node=2 01_send_recv.py [--blocking]
  torchrun --nproc_per_node=N 01_send_recv.py   # on N GPUs, one per rank, with NCCL
On 2 nodes of G processes each, run this on node K = 0 and on node K = 1:
  torchrun --nnodes=2 --node_rank=K --nproc_per_node=G --master_addr=HOST 01_send_recv.py
"""

import argparse
import math
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

# torchrun gives each process these variables. The setup block at the end of this file reads two of
# them into RANK and WORLD, which the code below uses.
#   RANK, WORLD_SIZE              Its number in the whole job, from 0, and the number of processes.
#   LOCAL_RANK, LOCAL_WORLD_SIZE  The same on its own node. The local rank picks the GPU.
#   GROUP_RANK                    The node's number, which torchrun was given as --node_rank.
#   MASTER_ADDR, MASTER_PORT      Where rank 0 keeps the store. The others dial it to meet.
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                 "MASTER_ADDR", "MASTER_PORT")


# --- the idea: join the job, then send messages between ranks ---
def setup(args):
    """1. Join. Pick this rank's device, then make the processes one group. Returns the device."""
    device, backend = pick_device(args)  # The rule is with the plumbing below, and in docs/gpus.md.
    if device.type == "cuda":
        torch.cuda.set_device(device)  # Before joining, so that NCCL ties this rank to its GPU.
    # Every rank dials MASTER_ADDR:MASTER_PORT and waits there until all WORLD_SIZE ranks have come.
    # The timeout bounds every later wait on a peer. A dead peer then ends the job, never hangs it.
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout_s))
    return device


def log(*msg):  # A line from this rank, tagged, in one write. The ranks' lines come in any order.
    print(f"[rank {RANK}/{WORLD}] " + " ".join(map(str, msg)) + "\n", end="", flush=True)


def who_am_i(device):  # This rank's torchrun variables and its device, on one line.
    log(*[f"{name}={os.environ.get(name, '-')}" for name in TORCHRUN_VARS], f"device={device}")
    assert (dist.get_rank(), dist.get_world_size()) == (RANK, WORLD)  # Joining read them there.


def main(args):
    if WORLD < 2:  # Plain `python 01_send_recv.py` sets none of torchrun's variables.
        raise UsageError("this lesson needs 2 or more ranks, so launch with torchrun, "
                         f"e.g. torchrun --nproc_per_node=2 {sys.argv[0]}")
    device = setup(args)
    if args.blocking and dist.get_backend() == "nccl":  # On NCCL, send() returns at once.
        raise UsageError("--blocking shows the deadlock on gloo only, so add --backend gloo")
    who_am_i(device)
    if dist.get_backend() == "gloo" and device.type == "cuda":  # NCCL would send GPU memory.
        print0("note: gloo sends CPU tensors only, so the messages below are staged on the CPU")
        device = torch.device("cpu")

    # 2. Blocking. Each call returns only when the message is handed over, so the order matters.
    if RANK == 0:
        for dst in range(1, WORLD):
            dist.send(torch.full((4,), float(dst), device=device), dst=dst)
        log("send/recv: sent a tensor to every other rank")
    else:
        got = torch.empty(4, device=device)
        dist.recv(got, src=0)
        assert torch.equal(got, torch.full((4,), float(RANK), device=device))
        log(f"send/recv: got {got.tolist()} from rank 0")

    # 3. Non-blocking. isend and irecv return a handle at once. We can compute while bytes travel.
    mine = torch.tensor([RANK * 10.0, RANK * 10.0 + 1], device=device)
    if RANK == 0:
        inbox = [mine] + [torch.empty(2, device=device) for _ in range(1, WORLD)]
        handles = [dist.irecv(inbox[r], src=r) for r in range(1, WORLD)]
        torch.randn(256, 256, device=device).exp_()  # Work done while the messages arrive.
        for h in handles:
            h.wait()  # Only now may we read the inbox.
    else:
        dist.isend(mine, dst=0).wait()  # The buffer must not change until wait() returns.
    library = [torch.empty(2, device=device) for _ in range(WORLD)] if RANK == 0 else None
    dist.gather(mine, gather_list=library, dst=0)  # The library's call, and our first collective.
    if RANK == 0:
        assert all(map(torch.equal, inbox, library)), "hand-written gather != dist.gather"
        print0(f"isend/irecv gather: {[t.tolist() for t in inbox]} == dist.gather")

    # 4a. A ring shift. Every rank sends to its right and receives from its left, at the same time.
    right, left = (RANK + 1) % WORLD, (RANK - 1) % WORLD
    send, recv = torch.full((3,), float(RANK), device=device), torch.empty(3, device=device)
    if args.blocking:
        # Break it. A blocking send() returns only once the receiver has posted its recv(). But each
        # receiver sits in its own send(), so no rank reaches recv(). All wait until the timeout.
        print0("ring shift, --blocking: send() to the right, then recv() from the left ...")
        try:
            dist.send(send, dst=right)
            dist.recv(recv, src=left)
        except RuntimeError:  # gloo's "Timed out waiting ... for send operation to complete"
            print0("deadlock: every rank waited in send() for a recv() that nobody posted, "
                   f"until the {args.timeout_s:g} s timeout (--timeout-s) ended it")
            print0("OK --blocking deadlocked, as promised. The normal run posts both sides at "
                   "once, with batch_isend_irecv.")
            os._exit(0)  # The demo is done. The sends are still posted, so skip the teardown.
    # batch_isend_irecv posts the send and the receive together, so neither waits for the other.
    ops = [dist.P2POp(dist.isend, send, right), dist.P2POp(dist.irecv, recv, left)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    log(f"ring shift: got {recv[0].item():.0f} from rank {left}")
    # Checked with the library. Each rank must hold what its left neighbour sent. For rank 0 that
    # is ranks[-1][0], the last rank's, which closes the ring.
    ranks = [torch.empty(2, 3, device=device) for _ in range(WORLD)]
    dist.all_gather(ranks, torch.stack([send, recv]))  # Every rank's (sent, received), in order.
    assert all(torch.equal(ranks[r][1], ranks[r - 1][0]) for r in range(WORLD)), "wrong neighbour"
    print0("ring shift: every rank got its left neighbour's tensor, as dist.all_gather shows")

    # 4b. A token goes round the ring, hop by hop. Rank r receives it from r-1, adds r, sends it on.
    # A rank that failed a check never passes it on. So a token back on rank 0 means all passed.
    token = torch.zeros(1, device=device)
    if RANK == 0:
        dist.send(token, dst=right)  # Rank 0 starts the ring. The others wait for the token first.
        dist.recv(token, src=left)
        assert token.item() == sum(range(WORLD)), token
        print0(f"token ring: came back as {token.item():.0f} = 0+1+...+{WORLD - 1}")
    else:
        dist.recv(token, src=left)
        token += RANK
        dist.send(token, dst=right)
    print0(f"OK send/recv, isend/irecv, ring shift and token ring checked on {WORLD} ranks")


# --- plumbing the lesson calls: the device rule, flags ---
def pick_device(args):
    """The device rule (docs/gpus.md). NCCL needs a GPU per rank, so local rank r takes GPU r if the
    node has enough. Otherwise the ranks use the CPU and gloo, or share GPUs with --device cuda."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = 0 if args.device == "cpu" else torch.cuda.device_count()  # --device cpu never asks CUDA.
    backend = args.backend or ("nccl" if gpus >= local_world else "gloo")
    if (args.device == "cuda" and gpus == 0) or (backend == "nccl" and gpus < local_world):
        raise UsageError(f"--backend {backend}: {gpus} CUDA GPU(s) for {local_world} ranks")
    on_gpu = gpus >= local_world or args.device == "cuda"
    device = torch.device(f"cuda:{local_rank % gpus}" if on_gpu else "cpu")
    print0(f"device: {device.type}, {backend} "
           f"(--device {args.device}, {gpus} GPU(s) for {local_world} ranks/node)")
    return device, backend


def parse_args():
    p = Parser(__doc__)
    p.add_argument("--blocking", action="store_true", help="break it: the ring shift on blocking "
                   "send() then recv(), a deadlock that the timeout ends (10 s unless --timeout-s)")
    args = p.parse_args()
    if args.blocking and args.timeout_s == p.get_default("timeout_s"):
        args.timeout_s = 10.0  # The deadlock lasts until the timeout, so keep it short.
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
