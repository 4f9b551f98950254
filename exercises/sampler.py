"""Rung 3: DistributedSampler by hand (the lesson: 04_sampler.py).

Check it:  python exercises/check.py sampler
"""

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)


class DistributedSampler(torch.utils.data.Sampler):
    """Give rank ``rank`` of ``num_replicas`` its share of ``dataset``'s indices: exactly the indices that
    torch.utils.data.DistributedSampler yields with the same arguments.

    Contract (torch's):
      - num_replicas and rank default to the process group's world size and rank;
      - every rank gets the same number of indices, ceil(n / N): the index list is padded by repeating its
        first indices up to a multiple of N; with drop_last, the tail is dropped instead (floor(n / N) each);
      - rank r takes every N-th index, starting at r;
      - shuffle: one permutation shared by all ranks, from torch.randperm(n, generator=g) with
        g = torch.Generator() seeded with seed + epoch; set_epoch(epoch) changes it for the next epoch;
      - len(sampler) is the number of indices this rank yields.
    The checker compares every rank's indices with torch's over a grid of sizes, replica counts, seeds and
    epochs (no processes needed: it passes num_replicas and rank).

    Hints:
      - the padding and the striding come after the shuffle, in that order;
      - compute num_samples and total_size in __init__, the indices in __iter__ (the epoch may change).
    """

    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0, drop_last=False):
        raise NotImplementedError

    def set_epoch(self, epoch):
        raise NotImplementedError

    def __iter__(self):
        raise NotImplementedError

    def __len__(self):
        raise NotImplementedError
