"""06: native DDP on ResNet18, the MNIST loading path on test-written IDX files, checkpoints and restarts."""

import re
import struct

import numpy as np
import pytest
import torch

import launch

SCRIPT = "06_torch_ddp_resnet.py"
FAKE = ["--dataset", "fake", "--fake-size", "64", "--batch-size", "8", "--epochs", "2"]


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


def test_offline_without_mnist_is_one_clear_error(tmp_path):
    # A proxy on a closed local port makes the download fail at once, even on a machine with internet.
    offline = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}
    res = launch.torchrun(SCRIPT, 2, ["--data-dir", tmp_path / "empty"], timeout=120, **offline)
    assert not res.timed_out and res.returncode != 0, res.output
    errors = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "could not be downloaded" in errors[0] and "--dataset fake" in errors[0], res.output


def test_checkpoint_and_model_load_into_build_model(tmp_path, script):
    res = launch.torchrun(SCRIPT, 2, FAKE + ["--epochs", "1", "--out", tmp_path], timeout=180)
    assert res.returncode == 0 and res.ok_line(), res.output
    ckpt = torch.load(tmp_path / "checkpoint.pt")
    assert set(ckpt) == {"model", "optimizer", "scheduler", "scaler", "epoch"} and ckpt["epoch"] == 1
    state = torch.load(tmp_path / "model.pt")
    assert not any(k.startswith("module.") for k in state)
    model = script(SCRIPT).build_model()
    model.load_state_dict(state)  # strict: every key matches build_model()
    assert all(torch.equal(state[k], v) for k, v in ckpt["model"].items())
    assert not list(tmp_path.glob("*.tmp"))


def test_killed_worker_resumes_to_the_same_weights(tmp_path):
    whole = launch.torchrun(SCRIPT, 2, FAKE + ["--out", tmp_path / "whole"], timeout=180)
    assert whole.returncode == 0, whole.output
    # 64 samples / 2 ranks / batch 8 = 4 steps per epoch: step 6 is inside epoch 2, after epoch 1's checkpoint.
    crashed = launch.torchrun(SCRIPT, 2, FAKE + ["--out", tmp_path / "crashed", "--crash-at-step", "6"],
                              torchrun_args=["--max-restarts=1"], timeout=240)
    assert crashed.returncode == 0 and crashed.ok_line(), crashed.output
    assert "SIGKILL to myself" in crashed.output and "after epoch 1" in crashed.output, crashed.output
    a, b = torch.load(tmp_path / "whole" / "model.pt"), torch.load(tmp_path / "crashed" / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed run != uninterrupted run"


def test_spawn_without_torchrun():
    res = launch.python(SCRIPT, FAKE + ["--epochs", "1", "--nproc", "2", "--precision", "bf16"], timeout=180)
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
