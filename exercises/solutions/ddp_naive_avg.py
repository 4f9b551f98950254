"""Another correct average_gradients, in a style other than the hints': one all-reduce with ReduceOp.AVG."""

import torch.distributed as dist


def average_gradients(model, world):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)  # the mean in one call: no division of our own
