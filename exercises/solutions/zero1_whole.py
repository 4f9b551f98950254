"""Another correct ZeroDDP. Each rank owns whole parameters, steps them, and broadcasts them.

The largest parameter goes first, to the rank that owns the fewest elements so far."""

import torch.distributed as dist
import torch.nn as nn


class ZeroDDP(nn.Module):
    def __init__(self, module, optimizer_class, **defaults):
        super().__init__()
        self.module, self.world, self.rank = module, dist.get_world_size(), dist.get_rank()
        for p in module.parameters():
            dist.broadcast(p.data, src=0)
        self.params = [p for p in module.parameters() if p.requires_grad]
        load, self.owner = [0] * self.world, {}
        for p in sorted(self.params, key=lambda p: -p.numel()):
            r = load.index(min(load))
            self.owner[p], load[r] = r, load[r] + p.numel()
        mine = [p for p in self.params if self.owner[p] == self.rank]
        self.optim = optimizer_class(mine, **defaults)

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def step(self):
        for p in self.params:
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        self.optim.step()
        for p in self.params:
            dist.broadcast(p.data, src=self.owner[p])

    def zero_grad(self, set_to_none=True):
        self.module.zero_grad(set_to_none)
