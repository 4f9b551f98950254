"""A participant's ZeroDDP (stage 1), as the stub asks. The tests plant mistakes in a copy of it."""

import torch
import torch.distributed as dist
import torch.nn as nn

# renamed in torch 2.14
all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


class ZeroDDP(nn.Module):
    def __init__(self, module, optimizer_class, **defaults):
        super().__init__()
        self.module, self.world, self.rank = module, dist.get_world_size(), dist.get_rank()
        self.params = [p for p in module.parameters() if p.requires_grad]
        total = sum(p.numel() for p in self.params)
        self.size = -(-total // self.world)  # ceil: the buffer is padded to N equal shards
        self.flat = torch.zeros(self.size * self.world)
        offset = 0
        for p in self.params:
            view = self.flat[offset:offset + p.numel()]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view_as(p)
            offset += p.numel()
        dist.broadcast(self.flat, src=0)  # replicas start as rank 0's
        # my shard of the buffer
        self.lo, self.hi = self.rank * self.size, (self.rank + 1) * self.size
        self.shard = self.flat[self.lo:self.hi]
        self.shard.grad = torch.zeros_like(self.shard)
        self.optim = optimizer_class([self.shard], **defaults)

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def step(self):
        grads = torch.zeros_like(self.flat)
        used = sum(p.numel() for p in self.params)
        torch.cat([p.grad.reshape(-1) for p in self.params], out=grads[:used])
        grads.mul_(1 / self.world)
        dist.all_reduce(grads)
        self.shard.grad.copy_(grads[self.lo:self.hi])
        self.optim.step()
        all_gather(self.flat, self.shard.detach().clone())

    def zero_grad(self, set_to_none=True):
        self.module.zero_grad(set_to_none)
