"""Rung 8: find the bug. The lesson is 09_debugging.py.

This file is not a stub. It runs, the loss goes down, and nothing fails. But after training, the
ranks no longer hold the same model. Find which tensors drift, and why. Then fix `train`, so that
every rank ends with the same model, bit for bit.

See it:    torchrun --nproc_per_node=2 exercises/find_the_bug.py   (the loss, then the verdict)
Check it:  python exercises/check.py find_the_bug

Two tools help. check_replicas(model) names the first tensor that differs, the ranks, and by how
much. It comes from debug_tools.py, and this file calls it at the end. The troubleshooting table in
docs/debugging.md lists the usual causes of drift.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F


def train(model, batches, lr=0.1, max_norm=0.5):
    """Data parallel by hand. `model` is the same on every rank when called.

    `batches` are this rank's own. Afterwards every parameter and buffer must be the same on every
    rank, bit for bit. The parameters must be those of SGD on the gradient averaged over the ranks,
    with its norm clipped to `max_norm`.
    """
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step, (x, y) in enumerate(batches):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        if dist.get_rank() == 0:
            print(f"step {step}  loss {loss.item():.4f}", flush=True)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
    return model


if __name__ == "__main__":  # torchrun --nproc_per_node=2 exercises/find_the_bug.py
    import os
    import sys

    import torch.nn as nn
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from lessons import load
    dist.init_process_group("gloo")
    debugging = load("09_debugging.py")
    torch.manual_seed(0)  # the same model on every rank
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    g = torch.Generator().manual_seed(dist.get_rank())  # each rank its own data
    batches = [(torch.randn(8, 6, generator=g) * 3, torch.randn(8, 1, generator=g))
               for _ in range(6)]
    train(model, batches)
    debugging.check_replicas(model)  # raises on every rank, naming the first tensor that differs
    print(f"rank {dist.get_rank()}: the replicas are identical", flush=True)
    dist.destroy_process_group()
