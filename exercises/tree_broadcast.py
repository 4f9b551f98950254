"""Rung 1: broadcast by hand, as a binomial tree. The lesson is 02_broadcast.py.

Check it:  python exercises/check.py tree_broadcast
"""

import torch.distributed as dist  # noqa: F401  (you will need it)


def tree_broadcast(tensor, src):
    """Copy rank ``src``'s ``tensor`` to every other rank, in place, with point-to-point messages.

    Contract:
      - Every rank passes a tensor of the same shape and dtype. Afterwards all hold src's values.
      - Write into ``tensor`` itself. The caller keeps using that object.
      - Build a tree, not a line. It takes ceil(log2 N) rounds. The source sends one message per
        round, and every other rank receives exactly once.
    The checker runs it on 4 ranks, with each rank as the source in turn.

    Hints:
      - Number the ranks from the source, so that the source is 0. That is vrank = (rank - src) % N.
        A partner's real rank is then (its vrank + src) % N.
      - In round k, let step = 2**k. The ranks with vrank < step hold the data. Each sends to
        vrank + step, if it exists. A rank with step <= vrank < 2 * step receives from vrank - step.
      - A rank is in one pair at most per round, so blocking send and recv cannot deadlock here.
    """
    raise NotImplementedError
