"""Rung 4: data parallel, the naive way: average the gradients after backward (the lesson: 05_manual_ddp_gpt2.py,
its --impl naive).

Check it:  python exercises/check.py ddp_naive
"""

import torch.distributed as dist  # noqa: F401  (you will need it)


def average_gradients(model, world):
    """After ``loss.backward()``, make every parameter's ``.grad`` the mean of that gradient over the ``world``
    ranks, on every rank, so that identical replicas take identical optimizer steps.

    Contract:
      - called on every rank after backward and before ``optimizer.step()``; changes ``.grad`` only;
      - afterwards ``.grad`` equals what PyTorch's DistributedDataParallel leaves there (the checker trains a small
        model with both, on 2 ranks, where the two agree bit for bit).

    Hints:
      - dist.all_reduce sums, in place; the mean is the sum divided by the world size;
      - every parameter that requires a gradient takes part, biases included.
    """
    raise NotImplementedError
