"""Benchmark: point-to-point latency and bandwidth per message size, a ping-pong between ranks 0 and 1.

Small messages cost a fixed latency; large ones approach the link's bandwidth. That is why DDP packs gradients
into buckets instead of sending each tensor on its own (05_manual_ddp_gpt2.py).

  torchrun --nproc_per_node=2 benchmarks/send_recv.py [--max-bytes 4194304] [--json p2p.json]
"""

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import check_writable, load_script, write_json  # noqa: E402

lesson = load_script("01_send_recv.py")  # its setup block


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # GPU work is asynchronous: wait for it before reading a clock


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
            if lesson.RANK == 0:
                dist.send(buf, dst=1)
                dist.recv(buf, src=1)
            elif lesson.RANK == 1:
                dist.recv(buf, src=0)
                dist.send(buf, dst=0)
        sync(device)
        one_way = (time.perf_counter() - t0) / reps / 2
        assert torch.equal(buf, sent), f"ping-pong corrupted a {nbytes}-byte message"
        rows.append({"bytes": nbytes, "latency_us": one_way * 1e6, "bandwidth_mbps": nbytes / one_way / 1e6})
    return rows


def main(args):
    if lesson.WORLD < 2:
        raise lesson.UsageError("a ping-pong needs 2 ranks: torchrun --nproc_per_node=2 benchmarks/send_recv.py")
    device = lesson.setup(args)
    if device.type == "cuda" and dist.get_backend() == "gloo":  # a copy through the CPU would be measured instead
        raise lesson.UsageError("gloo's send/recv move CPU tensors only: measure GPU messages with --backend nccl "
                                "(a GPU per rank), or CPU ones with --device cpu")
    lesson.print0(f"world_size={lesson.WORLD} backend={dist.get_backend()} device={device.type} "
                  f"torch={torch.__version__}")
    sizes = [4 ** k for k in range(1, 40) if 4 ** k <= args.max_bytes]
    rows = ping_pong(device, sizes, args.iters) if lesson.RANK < 2 else []  # other ranks only wait
    lesson.print0("\n| bytes | one-way latency (us) | bandwidth (MB/s) |\n|---:|---:|---:|")
    for r in rows:
        lesson.print0(f"| {r['bytes']:>9,} | {r['latency_us']:>10.1f} | {r['bandwidth_mbps']:>10.1f} |")
    if lesson.RANK == 0 and args.json:
        write_json(args.json, {"world_size": lesson.WORLD, "backend": dist.get_backend(), "device": device.type,
                               "torch": torch.__version__, "rows": rows})
        lesson.print0(f"wrote {args.json}")
    dist.barrier(device_ids=[device.index] if dist.get_backend() == "nccl" else None)
    lesson.print0("OK ping-pong finished")


def parse_args():
    p = lesson.Parser(__doc__)
    p.add_argument("--max-bytes", type=lesson.at_least(4), default=4 << 20, help="largest message")
    p.add_argument("--iters", type=lesson.at_least(1), default=50, help="round trips per small message size")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    a = p.parse_args()
    try:
        check_writable(a.json, "--json")
    except OSError as e:
        p.error(str(e))
    return a


if __name__ == "__main__":
    lesson.run(main, parse_args)
