"""Rung 7: ZeRO stage 1: each rank keeps the optimizer state of its own shard only (the lesson: 07_zero.py).

Check it:  python exercises/check.py zero1
"""

import torch.distributed as dist  # noqa: F401  (you will need it)
import torch.nn as nn


class ZeroDDP(nn.Module):
    """Data parallel training with the optimizer sharded over the ranks. Use it as a model and an optimizer in one:

        model = ZeroDDP(module, torch.optim.AdamW, lr=1e-3)
        loss_fn(model(x), y).backward()
        model.step()
        model.zero_grad()

    Contract:
      - __init__ broadcasts rank 0's parameters, so replicas start identical;
      - after backward the gradients are averaged over the ranks, as under DDP (any way you like: the naive
        average after backward is fine here);
      - step(): this rank's optimizer, ``optimizer_class(..., **defaults)``, updates only this rank's shard, about
        1/N of the elements (so it holds 1/N of the optimizer state); then the updated shards are gathered, so
        every rank ends with every updated parameter;
      - the weights equal those of PyTorch's DDP with the same optimizer, step after step (checked with SGD and
        momentum, on 2 ranks, bit for bit); the shards of all ranks cover every element exactly once.

    Hints:
      - simplest: flatten all parameters into one buffer, pad it to a multiple of N, and make each parameter's
        data a view into it (p.data = view); rank r's shard is buffer[r * size : (r + 1) * size];
      - this rank's optimizer then has one parameter, its shard, whose .grad is the same slice of the averaged
        flat gradient; after its step, dist.all_gather_single(buffer, shard) (all_gather_into_tensor before torch
        2.14) puts every rank's update everywhere (the update is elementwise: sharding changes no bits).
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
