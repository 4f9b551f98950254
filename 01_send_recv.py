"""01 - Point-to-point messages: the only thing every collective is built from.

What it teaches, in order:
  1. blocking send/recv: rank 0 hands every other rank its own tensor;
  2. non-blocking isend/irecv: every rank sends to rank 0 at once, which overlaps the waiting with work,
     checked equal to the library's dist.gather;
  3. a token passed around a ring of all ranks (sequential), then a ring shift where every rank sends and
     receives at the same time (batch_isend_irecv: posting both sides together is what keeps NCCL from
     deadlocking);
  4. a ping-pong between ranks 0 and 1: latency and bandwidth per message size.

Run it (any N >= 2):
  CPU:      torchrun --nproc_per_node=2 01_send_recv.py
  N GPUs:   torchrun --nproc_per_node=N 01_send_recv.py        (nccl, one GPU per rank)
  2 nodes:  torchrun --nnodes=2 --node_rank=K --nproc_per_node=G --master_addr=HOST --master_port=29500 01_send_recv.py
"""

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

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


# --- the idea: point-to-point messages ---
def sync(device):
    """GPU work is asynchronous: wait for it before reading a clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ping_pong(device, sizes, iters):
    """Rank 0 sends n bytes to rank 1 and waits for them back. One-way time = round trip / 2."""
    rows = []
    for nbytes in sizes:
        buf = torch.arange(nbytes, dtype=torch.uint8, device=device)
        sent = buf.clone()
        reps = max(3, iters if nbytes <= 1 << 16 else iters // 5)
        for i in range(reps + 2):  # the first two round trips warm up the connection, untimed
            if i == 2:
                sync(device)
                t0 = time.perf_counter()
            if RANK == 0:
                dist.send(buf, dst=1)
                dist.recv(buf, src=1)
            elif RANK == 1:
                dist.recv(buf, src=0)
                dist.send(buf, dst=0)
        sync(device)
        one_way = (time.perf_counter() - t0) / reps / 2
        assert torch.equal(buf, sent), f"ping-pong corrupted a {nbytes}-byte message"
        rows.append((nbytes, one_way * 1e6, nbytes / one_way / 1e6))
    return rows


def main(args):
    device = setup(args)
    print0(f"world_size={WORLD} backend={dist.get_backend()} device={device.type} torch={torch.__version__}")

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

    # 4. Ping-pong between 0 and 1; other ranks just wait at the barrier.
    sizes = [4 ** k for k in range(1, 40) if 4 ** k <= args.max_bytes]
    rows = ping_pong(device, sizes, args.iters) if RANK < 2 else []
    if RANK == 0:
        print0("\n| bytes | one-way latency (us) | bandwidth (MB/s) |\n|---:|---:|---:|")
        for nbytes, us, mbps in rows:
            print0(f"| {nbytes:>9,} | {us:>10.1f} | {mbps:>10.1f} |")
    dist.barrier()
    print0(f"\nOK send/recv, isend/irecv, token ring, ring shift and ping-pong checked on {WORLD} ranks")
    teardown()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--max-bytes", type=int, default=4 << 20, help="largest ping-pong message")
    p.add_argument("--iters", type=int, default=50, help="round trips per small message size")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda if available")
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None, help="default: nccl on cuda, gloo on cpu")
    p.add_argument("--timeout-s", type=float, default=120, help="process-group timeout: a dead peer fails, not hangs")
    a = p.parse_args()
    if a.max_bytes < 4 or a.iters < 1 or a.timeout_s <= 0:
        p.error("--max-bytes must be >= 4, --iters >= 1 and --timeout-s > 0")
    main(a)
