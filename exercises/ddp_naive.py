"""Rung 4: average the gradients after backward. The lesson is 05_manual_ddp_gpt2.py --impl naive.

Check it:  python exercises/check.py ddp_naive
"""

import torch  # noqa: F401  (you will need them)
import torch.distributed as dist  # noqa: F401


def average_gradients(model, world):
    """After ``loss.backward()``, make each ``.grad`` the mean of that gradient over the ranks.

    ``world`` is the number of ranks. Identical replicas then take identical optimizer steps.

    Contract:
      - Every rank calls it after backward, before ``optimizer.step()``. It changes ``.grad`` only.
      - Afterwards ``.grad`` equals what PyTorch's DistributedDataParallel leaves there. The checker
        trains a small model with both, on 2 ranks, where the two agree bit for bit.
      - A layer may go unused on one rank, so it has no gradient there. The checker's last step
        does this.

    Hints:
      - dist.all_reduce sums in place. The mean is the sum divided by the world size.
      - Every parameter that requires a gradient takes part, biases too.
      - Every rank must join every all-reduce, in the same order. A parameter without a gradient on
        this rank still joins, with zeros.
    """
    raise NotImplementedError
