"""Rung 2: all-reduce by hand, as a ring (the lesson: 03_all_reduce.py).

Check it:  python exercises/check.py ring_all_reduce
"""

import torch.distributed as dist  # noqa: F401  (you will need it)


def ring_all_reduce(tensor):
    """Sum ``tensor`` over all ranks, in place, with a ring of point-to-point messages. Return ``tensor``.

    Contract:
      - afterwards every rank holds the element-wise sum of everyone's tensor (dist.all_reduce's result: exactly
        for integers, to rounding for random floats), bit-identical on every rank;
      - in place: the sum is written into ``tensor`` itself, whatever its shape, dtype or memory layout (the
        checker passes a transposed, non-contiguous one too), and ``tensor`` is returned;
      - any number of elements, even fewer than ranks, or none;
      - a ring: each rank sends 2(N-1)/N of the tensor in all, and only with send/recv (isend/irecv), no
        collective. The checker runs it on 3 ranks.

    Hints:
      - flatten (a contiguous copy if needed: copy the result back at the end) and cut it into N chunks with
        tensor_split(N): sizes may differ by one element;
      - reduce-scatter, N-1 steps: in step s, rank r sends chunk (r - s) % N to rank r + 1 and adds the chunk it
        receives from rank r - 1 into its chunk (r - s - 1) % N. Afterwards rank r holds the full sum of chunk
        (r + 1) % N: it owns it;
      - all-gather, N-1 steps: in step s, rank r sends chunk (r + 1 - s) % N and overwrites (no adding: the
        owner's bits must go round unchanged) its chunk (r - s) % N with what it receives;
      - every rank sends before it receives: a blocking dist.send would wait for a receive that nobody has
        posted yet. Use dist.isend / dist.irecv and wait for both.
    """
    raise NotImplementedError
