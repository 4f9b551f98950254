"""Run under torchrun: DDP on ResNet18 equals the average of per-shard gradients (not the whole batch).

BatchNorm normalises with the statistics of the batch it sees, so N ranks with B samples each compute the
gradients of N models on B samples, averaged: the right single-process reference. One model on all N*B
samples is a different computation, and the check that it differs keeps this test honest.
"""

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import load_script  # noqa: E402

build_model = load_script("06_torch_ddp_resnet.py").build_model


def shard(rank, n=4):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = build_model()
    init = copy.deepcopy(model)
    ddp = DDP(model)
    x, y = shard(rank)
    F.cross_entropy(ddp(x), y).backward()
    ours = [p.grad for p in model.parameters()]

    per_shard = [torch.zeros_like(p) for p in init.parameters()]
    for r in range(world):
        m = copy.deepcopy(init)
        xr, yr = shard(r)
        F.cross_entropy(m(xr), yr).backward()
        for acc, p in zip(per_shard, m.parameters()):
            acc += p.grad / world
    for a, b in zip(ours, per_shard):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), (a - b).abs().max()

    whole = copy.deepcopy(init)
    xs, ys = zip(*(shard(r) for r in range(world)))
    F.cross_entropy(whole(torch.cat(xs)), torch.cat(ys)).backward()
    assert not all(torch.allclose(a, p.grad, rtol=1e-4, atol=1e-5) for a, p in zip(ours, whole.parameters())), \
        "whole-batch gradients should differ from per-shard ones (BatchNorm statistics are per shard)"
    dist.barrier()
    if rank == 0:
        print(f"OK DDP ResNet18 gradients == mean of per-shard gradients on {world} ranks", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
