"""Rung 1: broadcast by hand, as a binomial tree (the lesson: 02_broadcast.py).

Check it:  python exercises/check.py tree_broadcast
"""

import torch.distributed as dist  # noqa: F401  (you will need it)


def tree_broadcast(tensor, src):
    """Overwrite ``tensor`` on every rank with rank ``src``'s values, in place, using point-to-point messages.

    Contract:
      - every rank calls it with a tensor of the same shape and dtype; afterwards all hold src's values;
      - in place: write into ``tensor`` itself (the caller keeps using that object);
      - a tree, not a line: in ceil(log2 N) rounds, the source sending one message per round, and every other
        rank receiving exactly once. The checker runs it on 4 ranks, with every rank as the source.

    Hints:
      - renumber the ranks relative to the source: vrank = (rank - src) % N, so the source is vrank 0;
        a partner's real rank is (vrank_partner + src) % N;
      - in round k (step = 2**k), the ranks that already hold the data (vrank < step) each send to vrank + step
        (if that rank exists), and the ranks step <= vrank < 2 * step receive from vrank - step. Within a round
        every rank is in at most one pair, so blocking dist.send / dist.recv cannot deadlock here.
    """
    raise NotImplementedError
