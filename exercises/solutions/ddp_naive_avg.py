"""Another correct average_gradients. It all-reduces with ReduceOp.AVG, unlike the hints."""

import torch
import torch.distributed as dist


def average_gradients(model, world):
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)  # the mean in one call, no division
