"""Rung 7: ZeRO stage 1. Each rank keeps the optimizer state of its own shard. See 07_zero.py.

Check it:  python exercises/check.py zero1
"""

import torch.distributed as dist  # noqa: F401  (you will need it)
import torch.nn as nn


class ZeroDDP(nn.Module):
    """It is a model and an optimizer in one, with the optimizer split over the ranks. For example:

        model = ZeroDDP(module, torch.optim.AdamW, lr=1e-3)
        loss_fn(model(x), y).backward()
        model.step()
        model.zero_grad()

    Contract:
      - __init__ broadcasts rank 0's parameters, so replicas start identical.
      - After backward the gradients are averaged over the ranks, as under DDP. Any way is fine
        here, even the naive average after backward.
      - step() runs this rank's optimizer, ``optimizer_class(..., **defaults)``, on this rank's
        shard only. That is about 1/N of the elements, so the rank holds 1/N of the optimizer
        state. Then the ranks gather the updated shards, and every rank ends with every parameter.
      - The weights equal those of PyTorch's DDP with the same optimizer, step after step. The
        checker uses SGD with momentum on 2 ranks, and compares bit for bit.
      - The shards of all ranks cover every element exactly once.

    Hints:
      - The simplest layout is one flat buffer for all parameters, padded to a multiple of N. Make
        each parameter's data a view into it (p.data = view).
      - Rank r's shard is then buffer[r * size : (r + 1) * size]. This rank's optimizer has one
        parameter, its shard. The shard's .grad is the same slice of the averaged flat gradient.
      - After the step, dist.all_gather_single(buffer, shard) puts every rank's update everywhere.
        Before torch 2.14 its name was all_gather_into_tensor. The update is elementwise, so
        sharding changes no bits.
    """

    def __init__(self, module, optimizer_class, **defaults):
        super().__init__()
        self.module = module
        raise NotImplementedError

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def step(self):
        raise NotImplementedError

    def zero_grad(self, set_to_none=True):
        self.module.zero_grad(set_to_none)
