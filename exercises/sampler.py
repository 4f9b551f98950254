"""Rung 3: DistributedSampler by hand. The lesson is 04_sampler.py.

Check it:  python exercises/check.py sampler
"""

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)


class DistributedSampler(torch.utils.data.Sampler):
    """Give rank ``rank`` of ``num_replicas`` its share of ``dataset``'s indices.

    Contract (that of torch.utils.data.DistributedSampler, whose indices it must match):
      - num_replicas and rank default to the process group's world size and rank.
      - Every rank gets the same number of indices, ceil(n / N). For that, the index list is padded
        with its own first indices, up to a multiple of N. With drop_last, the tail is dropped
        instead, and every rank gets floor(n / N).
      - Rank r takes every N-th index, starting at r.
      - With shuffle, all ranks share one permutation, torch.randperm(n, generator=g). Here
        g = torch.Generator() is seeded with seed + epoch, and set_epoch(epoch) sets the epoch.
      - len(sampler) is the number of indices this rank yields.
    The checker compares every rank's indices with torch's, over a grid of arguments and epochs.
    It starts no processes, since it passes num_replicas and rank.

    Hints:
      - Shuffle first, then pad, then take every N-th index.
      - Compute num_samples and total_size in __init__. Compute the indices in __iter__, because
        the epoch may change.
    """

    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0,
                 drop_last=False):
        raise NotImplementedError

    def set_epoch(self, epoch):
        raise NotImplementedError

    def __iter__(self):
        raise NotImplementedError

    def __len__(self):
        raise NotImplementedError
