"""A participant's average_gradients, as the exercise asks for it: the tests plant mistakes into a copy of it."""

import torch.distributed as dist


def average_gradients(model, world):
    for p in model.parameters():
        if p.requires_grad:
            dist.all_reduce(p.grad)
            p.grad /= world
