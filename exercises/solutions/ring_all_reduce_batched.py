"""Another correct ring_all_reduce. Each step posts its send and receive together, with
dist.batch_isend_irecv."""

import torch
import torch.distributed as dist


def ring_all_reduce(tensor):
    world, rank = dist.get_world_size(), dist.get_rank()
    flat = tensor.reshape(-1).clone()  # always a copy: simpler, and copied back at the end
    chunks = list(flat.tensor_split(world))
    right, left = (rank + 1) % world, (rank - 1) % world

    def shift(send, recv):
        ops = [dist.P2POp(dist.isend, send, right), dist.P2POp(dist.irecv, recv, left)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    for s in range(world - 1):
        inbox = torch.empty_like(chunks[(rank - s - 1) % world])
        shift(chunks[(rank - s) % world], inbox)
        chunks[(rank - s - 1) % world] += inbox
    for s in range(world - 1):
        shift(chunks[(rank + 1 - s) % world], chunks[(rank - s) % world])
    tensor.copy_(flat.view_as(tensor))
    return tensor
