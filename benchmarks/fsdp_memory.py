"""Benchmark: peak memory per rank of 08's fully_shard, PyTorch's fully_shard and PyTorch's DDP, each launched alone.

  python benchmarks/fsdp_memory.py                    (8 x Linear(2048, 2048), AdamW, 2 ranks, 3 rounds)
  python benchmarks/fsdp_memory.py --nproc 3 --json fsdp_memory.json

The model of issue #19: a stack of square Linear layers, each an FSDP unit (then the root), AdamW, random data.
Each implementation trains in its own `torchrun` launch, so that nothing another one allocated stays resident;
the launches alternate in order over the rounds. On CPU the peak is the resident set's high-water mark
(`ru_maxrss`) with glibc's `MALLOC_MMAP_THRESHOLD_` fixed (128 KiB), so that freed tensors leave the resident
set at once and it counts what is held, not what was once held; `base` is the resident set just before the model
is built (torch, the process group). On a GPU (`--device cuda`) the peak is CUDA's allocator statistics.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import check_writable, load_script, write_json  # noqa: E402

IMPLS = ["DDP", "fully_shard", "ours"]
MMAP_THRESHOLD = 128 << 10


def worker(args):
    """One implementation under torchrun: train, then print one RESULT line per rank. (torch is imported here:
    the driver that launches the workers needs none of it.)"""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    fsdp = load_script("08_fsdp.py")
    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)]).to(device)
    if args.worker == "DDP":
        net = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    else:
        # fully_shard gets a mesh on the device chosen here: without one it builds it on the machine's accelerator
        mesh = DeviceMesh.from_group(dist.group.WORLD, device.type)
        for m in [*model, model]:  # each layer a unit, then the root
            fsdp.fully_shard(m) if args.worker == "ours" else torch_fully_shard(m, mesh=mesh)
        net = model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    seconds = []
    for _ in range(args.steps):
        x = torch.randn(args.batch, args.width, generator=g).to(device)
        t0 = time.perf_counter()
        net(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - t0)
    if cuda:
        peak, base = torch.cuda.max_memory_allocated(device) / 2**20, 0.0
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    ms = statistics.median(seconds[1:] or seconds) * 1e3  # the first step allocates AdamW's state
    print("RESULT " + json.dumps(dict(impl=args.worker, rank=rank, peak_mib=peak, base_mib=base, ms=ms)), flush=True)
    dist.destroy_process_group()


def launch(impl, args):
    """One torchrun launch of one implementation: its ranks' RESULT rows."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           os.path.abspath(__file__), "--worker", impl]
    for name in ("layers", "width", "batch", "steps", "device"):
        cmd += [f"--{name}", str(getattr(args, name))]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD), OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    rows = [json.loads(line.split(" ", 1)[1]) for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    if res.returncode or len(rows) != args.nproc:
        sys.exit(f"error: {impl} failed (exit {res.returncode}):\n{(res.stdout + res.stderr)[-2000:]}")
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks per launch")
    p.add_argument("--rounds", type=int, default=3, help="launches of each implementation, in alternating order")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=IMPLS, help="which to launch")
    p.add_argument("--layers", type=int, default=8, help="Linear layers, one unit each")
    p.add_argument("--width", type=int, default=2048, help="features in and out of each layer")
    p.add_argument("--batch", type=int, default=64, help="rows of random data per rank per step")
    p.add_argument("--steps", type=int, default=5, help="AdamW steps")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one GPU per rank, nccl")
    p.add_argument("--timeout-s", type=float, default=600, help="per launch")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--worker", choices=IMPLS, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if min(args.nproc, args.rounds, args.layers, args.width, args.batch, args.steps) < 1:
        p.error("--nproc, --rounds, --layers, --width, --batch and --steps must be >= 1")
    check_writable(args.json, "--json")
    rows = []
    for r in range(args.rounds):
        order = args.impls[r % len(args.impls):] + args.impls[:r % len(args.impls)]  # each goes first in turn
        for impl in order:
            rows += launch(impl, args)
            print(f"round {r + 1}/{args.rounds} {impl:<11} peak MiB per rank: "
                  + " ".join(f"{x['peak_mib']:,.1f}" for x in rows[-args.nproc:]), flush=True)
    mib = 4 * args.layers * (args.width ** 2 + args.width) / 2**20
    unit = "peak MiB (CUDA allocator)" if args.device == "cuda" else "peak resident set MiB"
    print(f"\n{args.layers} x Linear({args.width}, {args.width}) ({mib:.0f} MiB fp32), AdamW, batch {args.batch}, "
          f"{args.steps} steps, {args.nproc} ranks on {args.device}, {args.rounds} launches each\n")
    print(f"| | {unit}, min-max over ranks and launches | above base | ms/step (median) |\n|---|---:|---:|---:|")
    above = {}
    for impl in args.impls:
        mine = [x for x in rows if x["impl"] == impl]
        peaks = [x["peak_mib"] for x in mine]
        above[impl] = [x["peak_mib"] - x["base_mib"] for x in mine]
        print(f"| {impl} | {min(peaks):,.1f}-{max(peaks):,.1f} | {min(above[impl]):,.1f}-{max(above[impl]):,.1f} | "
              f"{statistics.median(x['ms'] for x in mine):.1f} |")
    if args.json:
        write_json(args.json, dict(args=vars(args), rows=rows))
    # The base moves by several MiB between launches of the same program (which pages of torch's libraries are
    # resident), so the training's own memory, the peak above base, is what compares.
    if not {"ours", "fully_shard"} <= above.keys():
        return
    ours, theirs = max(above["ours"]), min(above["fully_shard"])
    print(f"\nabove base, ours' highest ({ours:,.1f} MiB) is {'at most' if ours <= theirs else 'ABOVE'} fully_shard's "
          f"lowest ({theirs:,.1f} MiB)")

if __name__ == "__main__":
    main()
