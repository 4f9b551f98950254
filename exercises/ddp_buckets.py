"""Rung 6: DDP's core: gradients packed into buckets, each bucket's all-reduce launched from the hooks as soon as
the bucket is complete (the lesson: 05_manual_ddp_gpt2.py).

Check it:  python exercises/check.py ddp_buckets
"""

import contextlib

import torch.distributed as dist  # noqa: F401  (you will need it)
import torch.nn as nn


class DDPCore(nn.Module):
    """torch.nn.parallel.DistributedDataParallel's core, by hand. Use it as DDP:

        model = DDPCore(module, bucket_cap_mb=25)
        loss_fn(model(x), y).backward()     # when backward returns, every .grad is the mean over the ranks
        optimizer.step()

    Contract:
      - __init__ broadcasts rank 0's parameters (and, with broadcast_buffers, its buffers; the checker's model
        has none), so replicas start identical;
      - buckets in DDP's layout: the parameters in reverse registration order (backward produces the last layer's
        gradients first), a bucket closed once it holds bucket_cap_mb MiB or more (25 when None);
      - during backward, each bucket's all-reduce starts (async_op=True) as soon as all its gradients are ready,
        strictly in bucket order on every rank, the bucket multiplied by 1/N before the sum, as DDP does;
      - backward waits for all of them before it returns, and .grad holds the mean (what PyTorch's DDP leaves
        there: checked on 2 ranks, bit for bit). If you would rather wait in a method, name it
        finish_gradient_synchronization(): the checker calls it after backward when it exists;
      - inside ``with model.no_sync():`` backward sends nothing; gradients accumulate locally and the next
        backward outside it averages the sum.
    The checker passes bucket_cap_mb = 512 bytes, which gives its small model three buckets, one per layer
    (PyTorch's DDP sends one bucket in the very first step, then its real layout: both are accepted there). It
    then grades a second model whose gradients arrive in another order than the buckets (a layer registered last
    but used first, a layer used twice, a frozen one between): there a bucket launched the moment it is full goes
    out of turn. From the second step on, buckets rebuilt in the order the first backward produced the gradients
    (as PyTorch's DDP rebuilds them) are accepted too, launched in their own order.

    Hints:
      - a flat buffer per bucket, and each parameter's .grad a view into it, saves copying gradients in and out;
        copying each gradient into its bucket in the hook is fine too;
      - p.register_post_accumulate_grad_hook(fn) calls fn(p) right after p.grad has been written;
      - torch.autograd.Variable._execution_engine.queue_callback(fn), called from the first hook of a backward,
        runs fn when the whole backward is done: wait for the buckets there (and copy back, if you copied).
    """

    def __init__(self, module, process_group=None, bucket_cap_mb=None, broadcast_buffers=True):
        super().__init__()
        self.module = module
        raise NotImplementedError

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        raise NotImplementedError
        yield
