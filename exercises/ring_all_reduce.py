"""Rung 2: all-reduce by hand, as a ring. The lesson is 03_all_reduce.py.

Check it:  python exercises/check.py ring_all_reduce
"""

import torch.distributed as dist  # noqa: F401  (you will need it)


def ring_all_reduce(tensor):
    """Sum ``tensor`` over all ranks, in place, with a ring of messages. Return ``tensor``.

    Contract:
      - Afterwards every rank holds the same sum, bit for bit. It equals dist.all_reduce's result,
        exactly for integers and to rounding for random floats.
      - Write the sum into ``tensor`` itself, whatever its shape, dtype or memory layout. The
        checker also passes a transposed tensor, which is not contiguous.
      - Any number of elements works, even fewer than ranks, or none.
      - Use a ring. Each rank sends 2(N-1)/N of the tensor in all. Send only with send and recv, or
        with isend and irecv. Call no collective.
    The checker runs it on 3 ranks.

    Hints:
      - Flatten the tensor. If that makes a copy, copy the result back at the end. Cut it into N
        chunks with tensor_split(N). Their sizes may differ by one element.
      - First comes the reduce-scatter, in N-1 steps. In step s, rank r sends chunk (r - s) % N to
        rank r + 1. It adds the chunk it receives from rank r - 1 into its chunk (r - s - 1) % N.
        Afterwards rank r holds the full sum of chunk (r + 1) % N. It owns that chunk.
      - Then comes the all-gather, in N-1 steps. In step s, rank r sends chunk (r + 1 - s) % N. It
        overwrites its chunk (r - s) % N with what it receives. Do not add here. The owner's bits
        must go round unchanged.
      - Every rank sends before it receives. A blocking dist.send would wait for a receive that
        nobody has posted yet. Use dist.isend and dist.irecv, and wait for both.
    """
    raise NotImplementedError
