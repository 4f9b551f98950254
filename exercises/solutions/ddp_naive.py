"""A participant's average_gradients, as the stub asks. The tests plant mistakes in a copy of it."""

import torch
import torch.distributed as dist


def average_gradients(model, world):
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:  # no gradient on this rank: it joins the all-reduce with zeros
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad /= world
