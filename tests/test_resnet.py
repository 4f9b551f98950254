"""06: native DDP on ResNet18, its offline digits learned, the MNIST loading path on test-written IDX files,
checkpoints and restarts."""

import re
import struct

import numpy as np
import pytest
import torch

import launch

SCRIPT = "06_torch_ddp_resnet.py"


def write_idx(path, array):
    """The IDX format MNIST ships in: magic (0, 0, dtype=0x08 ubyte, ndim), big-endian dims, raw bytes."""
    path.write_bytes(struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
                     + array.astype(np.uint8).tobytes())


@pytest.fixture
def mnist_dir(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 32), ("t10k", 33)):
        write_idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, n))
    return tmp_path


def test_ddp_equals_per_shard_reference():
    res = launch.run(launch.torchrun_cmd("tests/workers/resnet_worker.py", 2), timeout=180)
    assert not res.timed_out and res.returncode == 0 and res.ok_line(), res.output



def test_the_offline_digits_are_one_data_set_with_something_to_learn(script):
    Digits = script(SCRIPT).SyntheticDigits
    train, again, val = Digits(200, offset=0), Digits(200, offset=0), Digits(50, offset=200)
    x, label = train[7]
    x2, label2 = again[7]
    assert x.shape == (1, 28, 28) and torch.equal(x, x2) and label == label2  # the same on every rank and run
    assert not any(torch.equal(val[i][0], train[j][0]) for i in range(50) for j in range(200))
    assert sorted({train[i][1] for i in range(200)}) == list(range(10))
    mean, std = script(SCRIPT).MNIST_MEAN, script(SCRIPT).MNIST_STD
    assert x.min() >= -mean / std - 1e-5 and x.max() <= (1 - mean) / std + 1e-5  # pixels in [0, 1], normalised


@pytest.mark.slow
def test_the_offline_run_learns_on_two_ranks():
    """A short run of 06 on --dataset fake (32 steps: ResNet18 from scratch needs them, about 20 s on 2 cores):
    validation accuracy rises, to three times chance (0.1) or more."""
    res = launch.torchrun(SCRIPT, 2, ["--dataset", "fake", "--fake-size", "512", "--batch-size", "16", "--epochs", "2"],
                          timeout=180)
    assert res.returncode == 0 and res.ok_line(), res.output
    acc = [float(a) for a in re.findall(r"val acc ([\d.]+) \(128 samples\)", res.output)]
    assert len(acc) == 2 and acc[1] > acc[0] and acc[1] >= 0.3, res.output

@pytest.mark.slow
def test_spawn_crash_restart_damage_and_continue(tmp_path, mnist_dir, script):
    args = ["--data-dir", mnist_dir, "--batch-size", "8", "--epochs", "2"]
    # The uninterrupted run without torchrun (--nproc 2 spawns the ranks), on the MNIST files: 33 validation
    # images on 2 ranks, which the sampler pads to 34; the padded duplicate must not be counted.
    whole = launch.python(SCRIPT, args + ["--nproc", "2", "--out", tmp_path / "whole"], timeout=180)
    assert whole.returncode == 0 and whole.ok_line() and "world_size=2" in whole.output, whole.output
    assert "data: mnist, 32 train / 33 val samples, 2 steps per epoch per rank" in whole.output, whole.output
    assert re.search(r"val acc [\d.]+ \(33 samples\)", whole.output), whole.output
    # Under torchrun, the last rank SIGKILLs itself at step 3, inside epoch 2 (2 steps an epoch), after epoch 1's
    # checkpoint; torchrun restarts both, they resume, and end where the spawned run ended, bit for bit.
    crashed = launch.torchrun(SCRIPT, 2, args + ["--out", tmp_path / "crashed", "--crash-at-step", "3"],
                              torchrun_args=["--max-restarts=1"], timeout=240)
    assert crashed.returncode == 0 and crashed.ok_line(), crashed.output
    assert "SIGKILL to myself" in crashed.output and "after epoch 1" in crashed.output, crashed.output
    a, b = torch.load(tmp_path / "whole" / "model.pt"), torch.load(tmp_path / "crashed" / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed run != uninterrupted run"
    # The checkpoint and the final model load into build_model(): no "module." prefix, nothing left over.
    out = tmp_path / "whole"
    ckpt = torch.load(out / "checkpoint-2" / "state.pt")
    assert set(ckpt) == {"model", "optimizer", "scheduler", "scaler", "epoch"} and ckpt["epoch"] == 2
    assert torch.load(out / "checkpoint-1" / "state.pt")["epoch"] == 1  # the one before is kept
    state = torch.load(out / "model.pt")
    assert not any(k.startswith("module.") for k in state) and not list(out.glob("*.tmp"))
    script(SCRIPT).build_model().load_state_dict(state)  # strict: every key matches
    assert all(torch.equal(state[k], v) for k, v in ckpt["model"].items())
    # The newest checkpoint is damaged: the run resumes from the one before (kept), and continues a finished run
    # with more epochs, the one-cycle schedule rebuilt for the new total.
    (out / "checkpoint-2" / "state.pt").write_bytes((out / "checkpoint-2" / "state.pt").read_bytes()[:1000])
    more = launch.torchrun(SCRIPT, 2, args[:-1] + ["3", "--out", out], timeout=180)
    assert more.returncode == 0 and more.ok_line(), more.output
    assert "warning: skipped" in more.output and "after epoch 1" in more.output, more.output
    assert "4 -> 6 steps: the one-cycle schedule is rebuilt" in more.output, more.output
    assert len(list(out.glob("checkpoint-2.damaged-*"))) == 1, "the damaged checkpoint was lost"
    assert torch.load(out / "checkpoint-3" / "state.pt")["epoch"] == 3


@pytest.mark.slow
def test_plain_python_is_one_process_and_sync_bn_explains_itself(mnist_dir):
    """The quick tier's run of the MNIST loading path, too."""
    res = launch.python(SCRIPT, ["--data-dir", mnist_dir, "--batch-size", "8", "--epochs", "1", "--sync-bn"],
                        timeout=180)
    assert res.returncode == 0 and res.ok_line() and "world_size=1" in res.output, res.output
    assert "data: mnist, 32 train / 33 val samples" in res.output and "CUDA-only" in res.output, res.output


def test_in_memory_batches_equal_the_dataloaders(script):
    """--input memory: the same samples per rank and epoch as the DataLoader path, through the same sampler."""
    import torchvision.datasets as D
    import torchvision.transforms as T
    from torch.utils.data import DataLoader, DistributedSampler
    InMemory = script(SCRIPT).InMemory
    data = D.FakeData(37, (1, 28, 28), 10, T.ToTensor(), random_offset=0)
    for rank in range(3):
        for drop_last in (True, False):
            sampler = DistributedSampler(data, num_replicas=3, rank=rank, shuffle=True, seed=0, drop_last=drop_last)
            memory = InMemory(data, sampler, 4, torch.device("cpu"), drop_last=drop_last)
            loader = DataLoader(data, 4, sampler=sampler, drop_last=drop_last)
            for epoch in (0, 1):
                sampler.set_epoch(epoch)
                ours, theirs = list(memory), list(loader)
                assert len(ours) == len(theirs) == len(memory) == len(loader) > 0
                for (x, y), (x2, y2) in zip(ours, theirs):
                    assert torch.equal(x, x2) and torch.equal(y, y2), (rank, drop_last, epoch)
