"""Rung 6: DDP's core, one all-reduce per bucket of gradients. The lesson is 05_manual_ddp_gpt2.py.

Check it:  python exercises/check.py ddp_buckets
"""

import contextlib

import torch.distributed as dist  # noqa: F401  (you will need it)
import torch.nn as nn


class DDPCore(nn.Module):
    """The core of torch.nn.parallel.DistributedDataParallel, by hand. Use it as you would use DDP:

        model = DDPCore(module, bucket_cap_mb=25)
        loss_fn(model(x), y).backward()  # when backward returns, each .grad is the mean
        optimizer.step()

    Contract:
      - __init__ broadcasts rank 0's parameters, and its buffers with broadcast_buffers, so
        replicas start identical.
      - The buckets follow DDP's layout. Take the parameters in reverse registration order, since
        backward produces the last layer's gradients first. Close a bucket once it holds
        bucket_cap_mb MiB or more (25 when None).
      - During backward, each bucket's all-reduce starts with async_op=True once all its gradients
        are ready. The buckets start strictly in bucket order, on every rank. Multiply each bucket
        by 1/N before the sum, as DDP does.
      - Backward waits for all of them before it returns. Then .grad holds the mean, as PyTorch's
        DDP leaves it, bit for bit on 2 ranks. Or wait in finish_gradient_synchronization(), which
        the checker calls after backward if it exists.
      - Inside ``with model.no_sync():`` backward sends nothing. The gradients add up locally, and
        the next backward outside it averages the sum.

    What the checker does:
      - It passes bucket_cap_mb = 512 bytes. Its small model then has three buckets, one per layer.
      - PyTorch's DDP sends one bucket in its first step. The checker accepts both layouts there.
      - A second model's gradients arrive in another order than its buckets. One layer is
        registered last but used first, one is used twice, and a frozen one sits between. There a
        bucket launched the moment it is full goes out of turn.
      - From the second step on, it also accepts buckets rebuilt as PyTorch's DDP rebuilds them, in
        the order the first backward produced the gradients.

    Hints:
      - A flat buffer per bucket saves copies if each parameter's .grad is a view into it. Copying
        each gradient into its bucket in the hook is fine too.
      - p.register_post_accumulate_grad_hook(fn) calls fn(p) right after p.grad has been written.
      - torch.autograd.Variable._execution_engine.queue_callback(fn), called from the first hook of
        a backward, runs fn when the backward is done. Wait for the buckets there.
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
