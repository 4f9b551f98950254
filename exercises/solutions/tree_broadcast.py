"""A participant's tree_broadcast, as the stub asks. The tests plant mistakes in a copy of it."""

import math

import torch.distributed as dist


def tree_broadcast(tensor, src):
    rank, world = dist.get_rank(), dist.get_world_size()
    vrank = (rank - src) % world  # the source is vrank 0
    for k in range(math.ceil(math.log2(world))):
        step = 1 << k
        if vrank < step and vrank + step < world:
            dist.send(tensor, dst=(vrank + step + src) % world)
        elif step <= vrank < 2 * step:
            dist.recv(tensor, src=(vrank - step + src) % world)
