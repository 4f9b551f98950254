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


@pytest.mark.parametrize("nproc", [2, 3])
@pytest.mark.parametrize("name", list(SCRIPTS))
def test_script_checks_itself(name, nproc):
    res = launch.torchrun(name, nproc, SCRIPTS[name], timeout=120)
    assert not res.timed_out and res.returncode == 0, res.output
    assert res.ok_line(), res.output
    # Per-rank lines must come from every rank, tagged "[rank r/N]", for the scripts that print them.
    if name != "03_all_reduce.py":
        for r in range(nproc):
            assert f"[rank {r}/{nproc}]" in res.output, res.output


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_plain_python_says_how_to_launch(name):
    res = launch.python(name, timeout=60)
    assert res.returncode != 0
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and "torchrun --nproc_per_node" in lines[0], res.output


def test_single_rank_rejected():
    res = launch.torchrun("03_all_reduce.py", 1, timeout=60)
    assert res.returncode != 0 and "at least 2 ranks" in res.output, res.output


def test_broadcast_rejects_bad_src_before_starting():
    res = launch.torchrun("02_broadcast.py", 2, ["--src", "5"], timeout=60)
    assert res.returncode != 0 and "--src 5 is not a rank" in res.output, res.output


@pytest.mark.parametrize("nproc", [2, 3])
def test_ring_all_reduce_matches_library(nproc):
    res = launch.run(launch.torchrun_cmd("tests/workers/ring_worker.py", nproc), timeout=240)
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
    cases = 0
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
                cases += 1
    assert cases > 1000


@pytest.mark.parametrize("rank,replicas", [(3, 3), (-1, 2), (10, 4)])
def test_sampler_rejects_bad_rank_like_torch(script, rank, replicas):
    Ours = script("04_sampler.py").DistributedSampler
    with pytest.raises(ValueError) as ref:
        torch.utils.data.DistributedSampler(range(10), num_replicas=replicas, rank=rank)
    with pytest.raises(ValueError) as ours:
        Ours(range(10), num_replicas=replicas, rank=rank)
    assert str(ours.value) == str(ref.value)
