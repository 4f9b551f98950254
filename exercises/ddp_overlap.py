"""Rung 5: overlap communication with backward.

Each parameter gets one asynchronous all-reduce. A hook launches it the moment that parameter's
gradient is ready. This is the idea behind 05_manual_ddp_gpt2.py, before it adds buckets.

Check it:  python exercises/check.py ddp_overlap
"""

import torch.distributed as dist  # noqa: F401  (you will need it)
import torch.nn as nn


class OverlapDDP(nn.Module):
    """Wrap ``module`` for data-parallel training. Call it as you would call the module, then:

        loss.backward()
        model.finish_gradient_synchronization()
        optimizer.step()

    Contract:
      - __init__ broadcasts rank 0's parameters, so replicas built with other seeds start equal.
      - During backward, as each parameter's gradient is ready, one all-reduce for it starts with
        async_op=True. Communication then overlaps the rest of backward. The checker counts the
        all-reduces, when they start, and whether they block.
      - finish_gradient_synchronization() waits for all of them. Then each .grad is the mean over
        the ranks, as PyTorch's DistributedDataParallel leaves it, bit for bit on 2 ranks.

    Hints:
      - p.register_post_accumulate_grad_hook(fn) calls fn(p) right after p.grad has been written.
      - dist.all_reduce(p.grad, async_op=True) returns a Work. Keep it, and wait for it at the end.
      - Divide by the world size before the launch, or after wait(). Never divide in between, while
        the all-reduce may still read the gradient.
    """

    def __init__(self, module):
        super().__init__()
        self.module = module
        raise NotImplementedError

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def finish_gradient_synchronization(self):
        raise NotImplementedError
