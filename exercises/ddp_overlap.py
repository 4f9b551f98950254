"""Rung 5: overlap communication with backward: one asynchronous all-reduce per parameter, launched from a hook
the moment that parameter's gradient is ready (the idea behind 05_manual_ddp_gpt2.py, before buckets).

Check it:  python exercises/check.py ddp_overlap
"""

import torch.distributed as dist  # noqa: F401  (you will need it)
import torch.nn as nn


class OverlapDDP(nn.Module):
    """Wrap ``module`` for data-parallel training: call it as the module, then

        loss.backward()
        model.finish_gradient_synchronization()
        optimizer.step()

    Contract:
      - __init__ broadcasts rank 0's parameters, so replicas built with different seeds start identical;
      - during backward, as each parameter's gradient is ready, one all-reduce for that parameter starts with
        async_op=True: communication overlaps the rest of backward (the checker counts the all-reduces, when they
        start, and whether they block);
      - finish_gradient_synchronization() waits for every one of them; afterwards each .grad is the mean over the
        ranks, what PyTorch's DistributedDataParallel leaves there (checked on 2 ranks, bit for bit).

    Hints:
      - p.register_post_accumulate_grad_hook(fn) calls fn(p) right after p.grad has been written;
      - dist.all_reduce(p.grad, async_op=True) returns a Work: keep it, .wait() for it at the end, then divide
        (or divide first: p.grad.div_(world) before the sum also gives the mean).
    """

    def __init__(self, module):
        super().__init__()
        self.module = module
        raise NotImplementedError

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def finish_gradient_synchronization(self):
        raise NotImplementedError
