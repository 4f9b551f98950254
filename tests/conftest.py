import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
sys.path[:0] = [str(TESTS), str(REPO)]  # so tests can `import launch`, and `import lessons`

from lessons import load  # noqa: E402


def load_script(filename):
    """Import a numbered script afresh, so it reads the environment the test set (lessons.load)."""
    return load(filename, fresh=True)


def identical_across_ranks(tensors, group=None):
    """In a worker under torchrun: True on every rank of ``group`` iff ``tensors`` are bitwise equal on all of them."""
    import torch
    import torch.distributed as dist
    flat = torch.cat([t.detach().flatten() for t in tensors])
    ref = flat.clone()
    dist.broadcast(ref, src=dist.get_global_rank(group or dist.group.WORLD, 0), group=group)
    ok = torch.tensor([int(torch.equal(ref, flat))], device=flat.device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # one verdict for all, so every rank fails together
    return bool(ok.item())


@pytest.fixture
def script():
    return load_script


@pytest.fixture
def group_of_one():
    """A gloo process group of this one process (rank 0 of 1), for in-process tests; destroyed after the test."""
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()
