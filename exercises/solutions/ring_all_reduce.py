"""A participant's ring_all_reduce, as the stub asks. The tests plant mistakes in a copy of it."""

import torch.distributed as dist


def ring_all_reduce(tensor):
    world, rank = dist.get_world_size(), dist.get_rank()
    flat = tensor.contiguous().view(-1)  # a copy only when tensor is not contiguous
    chunks = flat.tensor_split(world)
    right, left = (rank + 1) % world, (rank - 1) % world
    for s in range(world - 1):  # reduce-scatter: afterwards rank r owns the sum of chunk r + 1
        send, recv = chunks[(rank - s) % world], chunks[(rank - s - 1) % world]
        inbox = recv.clone()
        reqs = [dist.isend(send, right), dist.irecv(inbox, left)]
        for req in reqs:
            req.wait()
        recv += inbox
    for s in range(world - 1):  # all-gather: the finished chunks go round, copied, never added
        send, recv = chunks[(rank + 1 - s) % world], chunks[(rank - s) % world]
        reqs = [dist.isend(send, right), dist.irecv(recv, left)]
        for req in reqs:
            req.wait()
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor
