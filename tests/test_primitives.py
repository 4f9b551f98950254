"""01-04: each script checks itself under 2 and 3 ranks; the hand-written pieces equal the library's."""

import itertools

import pytest
import torch.utils.data

import launch

SCRIPTS = {
    "01_send_recv.py": [],
    "02_broadcast.py": ["--src", "1"],
    "03_all_reduce.py": [],
    "04_sampler.py": [],
}


@pytest.mark.parametrize("name,nproc", [("01_send_recv.py", 2), ("02_broadcast.py", 3), ("03_all_reduce.py", 2),
                                        ("04_sampler.py", 2)])
def test_script_checks_itself(name, nproc):
    """Each script on 2 or 3 ranks (its errors and plain-python message: test_reliability's table)."""
    res = launch.torchrun(name, nproc, SCRIPTS[name], timeout=120)
    assert not res.timed_out and res.returncode == 0, res.output
    assert res.ok_line(), res.output
    # Per-rank lines must come from every rank, tagged "[rank r/N]", for the scripts that print them.
    if name != "03_all_reduce.py":
        for r in range(nproc):
            assert f"[rank {r}/{nproc}]" in res.output, res.output


def test_ring_all_reduce_matches_library():
    """3 ranks: chunks of unequal size, and sums of three terms whose order matters (2 ranks: 03's own run)."""
    res = launch.run(launch.torchrun_cmd("tests/workers/ring_worker.py", 3), timeout=240)
    assert not res.timed_out and res.returncode == 0, res.output
    assert res.ok_line(), res.output


def test_imports_have_no_side_effects(script, capsys):
    import torch.distributed as dist
    ring = script("03_all_reduce.py").ring_all_reduce
    sampler = script("04_sampler.py").DistributedSampler
    assert callable(ring) and callable(sampler)
    assert not dist.is_initialized()
    assert capsys.readouterr().out == ""


def test_sampler_equals_torch_over_argument_grid(script):
    Ours = script("04_sampler.py").DistributedSampler
    for n, replicas, shuffle, seed, drop_last in itertools.product(
            [0, 1, 2, 3, 5, 10, 11, 17, 64, 101], [1, 2, 3, 4, 7], [True, False], [0, 42], [False, True]):
        data = list(range(n))
        for rank in range(replicas):
            kw = dict(num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
            ours, ref = Ours(data, **kw), torch.utils.data.DistributedSampler(data, **kw)
            for epoch in (0, 1, 5):
                ours.set_epoch(epoch)
                ref.set_epoch(epoch)
                assert list(ours) == list(ref), (n, kw, epoch)
                assert len(ours) == len(ref) == len(list(ours)), (n, kw, epoch)


@pytest.mark.parametrize("rank,replicas", [(3, 3), (-1, 2), (10, 4)])
def test_sampler_rejects_bad_rank_like_torch(script, rank, replicas):
    Ours = script("04_sampler.py").DistributedSampler
    with pytest.raises(ValueError):
        torch.utils.data.DistributedSampler(range(10), num_replicas=replicas, rank=rank)
    with pytest.raises(ValueError, match=f"Invalid rank {rank}") as ours:
        Ours(range(10), num_replicas=replicas, rank=rank)
    assert f"[0, {replicas - 1}]" in str(ours.value)
