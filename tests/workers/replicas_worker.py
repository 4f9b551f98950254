"""check_replicas (09_debugging.py) on every rank under torchrun: quiet on identical replicas; on a difference on
some ranks, the same RuntimeError on every rank naming the tensor, the ranks and the largest difference."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from conftest import load_script  # noqa: E402

check_replicas = load_script("09_debugging.py").check_replicas


def model(dtype=torch.float32):
    torch.manual_seed(0)  # the same replica on every rank
    m = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2)).to(dtype)
    m[2].requires_grad_(False)  # frozen: still part of the replica
    return m


def plus_one_ulp(t):  # the smallest change a dtype can hold
    t.copy_(torch.nextafter(t, torch.full_like(t, torch.inf)))


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
last, others = [world - 1], list(range(1, world))
CASES = [  # (name, dtype, ranks that change, the change, what the error must say)
    ("identical", torch.float32, [], None, None),
    ("a parameter", torch.float32, last, lambda m: m[0].weight.data[1, 2].add_(0.5), "differ: 0.weight "),
    ("a buffer", torch.float32, others, lambda m: m[1].running_var.add_(0.25), "differ: 1.running_var "),
    ("a frozen parameter", torch.float32, last, lambda m: m[2].bias.data.sub_(1.0), "differ: 2.bias "),
    ("bf16, one ulp", torch.bfloat16, last, lambda m: plus_one_ulp(m[0].bias.data[:1]), "differ: 0.bias (bfloat16"),
    ("fp16 -0.0", torch.float16, last, lambda m: m[1].running_mean.data.fill_(-0.0), "differ: 1.running_mean "),
]
for name, dtype, ranks, change, expected in CASES:
    m = model(dtype)
    if rank in ranks:
        change(m)
    try:
        check_replicas(m)
        message = None
    except RuntimeError as e:
        message = str(e)
    messages = [None] * world
    dist.all_gather_object(messages, message)
    assert len(set(messages)) == 1, f"{name}: not the same verdict on every rank: {messages}"
    if expected is None:
        assert message is None, f"{name}: {message}"
    else:
        assert message and expected in message and f"rank(s) {ranks} " in message, f"{name}: {message}"
    if rank == 0:
        print(f"{name}: {message or 'quiet'}", flush=True)
dist.destroy_process_group()
if rank == 0:
    print(f"OK check_replicas on {world} ranks: {len(CASES)} cases", flush=True)
