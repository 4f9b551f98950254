"""06: native DDP on ResNet18, the MNIST loading path on test-written IDX files, checkpoints and restarts."""

import re
import struct

import numpy as np
import pytest
import torch

import launch

SCRIPT = "06_torch_ddp_resnet.py"
FAKE = ["--dataset", "fake", "--fake-size", "32", "--batch-size", "8", "--epochs", "2"]


def write_idx(path, array):
    """The IDX format MNIST ships in: magic (0, 0, dtype=0x08 ubyte, ndim), big-endian dims, raw bytes."""
    path.write_bytes(struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
                     + array.astype(np.uint8).tobytes())


@pytest.fixture
def mnist_dir(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 48), ("t10k", 50)):
        write_idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, n))
    return tmp_path


def test_ddp_equals_per_shard_reference():
    res = launch.run(launch.torchrun_cmd("tests/workers/resnet_worker.py", 2), timeout=180)
    assert not res.timed_out and res.returncode == 0 and res.ok_line(), res.output


def test_mnist_from_idx_files_with_padded_validation(mnist_dir):
    # 50 validation images on 3 ranks: the sampler pads to 51; the padded duplicate must not be counted.
    res = launch.torchrun(SCRIPT, 3, ["--data-dir", mnist_dir, "--batch-size", "8", "--epochs", "1"], timeout=180)
    assert res.returncode == 0 and res.ok_line(), res.output
    assert "data: mnist, 48 train / 50 val samples, 2 steps per epoch per rank" in res.output, res.output
    assert re.search(r"val acc [\d.]+ \(50 samples\)", res.output), res.output


@pytest.mark.slow
def test_crash_restart_damage_and_continue(tmp_path, script):
    whole = launch.torchrun(SCRIPT, 2, FAKE + ["--out", tmp_path / "whole"], timeout=180)
    assert whole.returncode == 0 and whole.ok_line(), whole.output
    # 32 samples / 2 ranks / batch 8 = 2 steps per epoch: step 3 is inside epoch 2, after epoch 1's checkpoint.
    crashed = launch.torchrun(SCRIPT, 2, FAKE + ["--out", tmp_path / "crashed", "--crash-at-step", "3"],
                              torchrun_args=["--max-restarts=1"], timeout=240)
    assert crashed.returncode == 0 and crashed.ok_line(), crashed.output
    assert "SIGKILL to myself" in crashed.output and "after epoch 1" in crashed.output, crashed.output
    a, b = torch.load(tmp_path / "whole" / "model.pt"), torch.load(tmp_path / "crashed" / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed run != uninterrupted run"
    # The checkpoint and the final model load into build_model(): no "module." prefix, nothing left over.
    out = tmp_path / "whole"
    ckpt = torch.load(out / "checkpoint.pt")
    assert set(ckpt) == {"model", "optimizer", "scheduler", "scaler", "epoch"} and ckpt["epoch"] == 2
    assert torch.load(out / "checkpoint.pt.prev")["epoch"] == 1  # the one before is kept
    state = torch.load(out / "model.pt")
    assert not any(k.startswith("module.") for k in state) and not list(out.glob("*.tmp"))
    script(SCRIPT).build_model().load_state_dict(state)  # strict: every key matches
    assert all(torch.equal(state[k], v) for k, v in ckpt["model"].items())
    # The newest checkpoint is damaged: the run resumes from the one before (kept), and continues a finished run
    # with more epochs, the one-cycle schedule rebuilt for the new total.
    (out / "checkpoint.pt").write_bytes((out / "checkpoint.pt").read_bytes()[:1000])
    more = launch.torchrun(SCRIPT, 2, FAKE + ["--epochs", "3", "--out", out], timeout=180)
    assert more.returncode == 0 and more.ok_line(), more.output
    assert "warning: skipped" in more.output and "after epoch 1" in more.output, more.output
    assert "4 -> 6 steps: the one-cycle schedule is rebuilt" in more.output, more.output
    assert len(list(out.glob("checkpoint.pt.damaged-*"))) == 1 and torch.load(out / "checkpoint.pt")["epoch"] == 3


@pytest.mark.slow
def test_spawn_without_torchrun():
    res = launch.python(SCRIPT, FAKE + ["--epochs", "1", "--nproc", "2"], timeout=180)
    assert res.returncode == 0 and res.ok_line() and "world_size=2" in res.output, res.output


def test_plain_python_is_one_process_and_sync_bn_explains_itself():
    res = launch.python(SCRIPT, FAKE + ["--epochs", "1", "--sync-bn"], timeout=180)
    assert res.returncode == 0 and res.ok_line() and "world_size=1" in res.output, res.output
    assert "CUDA-only" in res.output


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
