"""A participant's average_gradients with async all-reduces, all waited for before dividing."""

import torch
import torch.distributed as dist


def average_gradients(model, world):
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:  # every rank joins every all-reduce
            p.grad = torch.zeros_like(p)
    works = [dist.all_reduce(p.grad, async_op=True) for p in params]
    for work in works:
        work.wait()
    for p in params:
        p.grad /= world
