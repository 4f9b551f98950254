"""Rung 6: DDP's core. Gradients go into buckets, and each bucket has one all-reduce.

The hooks launch a bucket's all-reduce as soon as the bucket is complete. The lesson is
05_manual_ddp_gpt2.py.

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
      - __init__ broadcasts rank 0's parameters, so replicas start identical. With
        broadcast_buffers it broadcasts rank 0's buffers too. The checker's model has none.
      - The buckets follow DDP's layout. Take the parameters in reverse registration order, since
        backward produces the last layer's gradients first. Close a bucket once it holds
        bucket_cap_mb MiB or more (25 when None).
      - During backward, each bucket's all-reduce starts with async_op=True once all its gradients
        are ready. The buckets start strictly in bucket order, on every rank. Multiply each bucket
        by 1/N before the sum, as DDP does.
      - Backward waits for all of them before it returns. Then .grad holds the mean, as PyTorch's
        DDP leaves it. The checker compares on 2 ranks, bit for bit.
      - You may wait in a method instead. Name it finish_gradient_synchronization(), and the checker
        calls it after backward.
      - Inside ``with model.no_sync():`` backward sends nothing. The gradients add up locally, and
        the next backward outside it averages the sum.

    What the checker does:
      - It passes bucket_cap_mb = 512 bytes. Its small model then has three buckets, one per layer.
      - PyTorch's DDP sends one bucket in the very first step, and its real layout after that. The
        checker accepts both in the first step.
      - It then grades a second model, whose gradients arrive in another order than the buckets.
        One layer is registered last but used first. One is used twice, and a frozen one sits
        between. A bucket launched the moment it is full then goes out of turn.
      - From the second step on, it also accepts the buckets that PyTorch's DDP rebuilds. Those
        follow the order in which the first backward produced the gradients. They go out in their
        own order.

    Hints:
      - A flat buffer per bucket saves copies if each parameter's .grad is a view into it. Copying
        each gradient into its bucket in the hook is fine too.
      - p.register_post_accumulate_grad_hook(fn) calls fn(p) right after p.grad has been written.
      - Call torch.autograd.Variable._execution_engine.queue_callback(fn) from the first hook of a
        backward. It runs fn when the whole backward is done. Wait for the buckets there, and copy
        back if you copied.
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
