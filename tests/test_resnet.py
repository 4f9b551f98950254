"""06: native DDP on ResNet18. Its own training equals one process's, its offline digits are learned, the MNIST
path runs on test-written IDX files, and the spawn path, checkpoints and restarts work."""

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
    """MNIST's four files, small and random: torchvision finds them there and downloads nothing."""
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 32), ("t10k", 33)):
        write_idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, n))
    return tmp_path


def test_06_trains_as_one_process_would_and_resumes_bit_for_bit(tmp_path):
    """06's own main() on 2 ranks against one process (tests/workers/resnet_worker.py): DistributedSampler's order
    each epoch, the weights, the printed training loss of all ranks, validation over the whole set once. Then,
    resumed from epoch 1's checkpoint alone, it ends bit for bit where it ended; asked again, it trains nothing."""
    res = launch.torchrun("tests/workers/resnet_worker.py", 2, [tmp_path], timeout=300, device=None)
    assert not res.timed_out and res.returncode == 0, res.output
    oks = [ln for ln in res.output.splitlines() if ln.startswith("OK 06 on 2 ranks")]
    assert len(oks) == 2 and (res.ok_line() or "").startswith("OK DDP ResNet18"), res.output


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


def test_the_learning_rate_warms_up_then_decays_to_zero(script):
    one_cycle = script(SCRIPT).one_cycle
    factors = [one_cycle(step, 10) for step in range(10)]
    assert factors[:2] == [0.5, 1.0] and factors[-1] > 0 and one_cycle(10, 10) == 0
    assert all(a >= b for a, b in zip(factors[1:], factors[2:]))


@pytest.mark.slow
def test_the_offline_run_learns_on_two_ranks():
    """A short run of 06 on --dataset fake (32 steps: ResNet18 from scratch needs them, about 20 s on 2 cores):
    validation accuracy rises, to three times chance (0.1) or more."""
    res = launch.torchrun(SCRIPT, 2, ["--dataset", "fake", "--fake-size", "512", "--batch-size", "16", "--epochs", "2"],
                          timeout=300)
    assert res.returncode == 0 and res.ok_line(), res.output
    acc = [float(a) for a in re.findall(r"val acc ([\d.]+) \(128 samples\)", res.output)]
    assert len(acc) == 2 and acc[1] > acc[0] and acc[1] >= 0.3, res.output


@pytest.mark.slow
def test_spawn_killed_restarted_damaged_and_continued(tmp_path, mnist_dir):
    args = ["--data-dir", mnist_dir, "--batch-size", "8", "--epochs", "3"]
    # The uninterrupted run without torchrun (--nproc 2 spawns the ranks), on the MNIST files: 33 validation
    # images on 2 ranks, which the sampler pads to 34; the padded repeat must not be counted.
    whole = launch.python(SCRIPT, args + ["--nproc", "2", "--out", tmp_path / "whole"], timeout=300)
    assert whole.returncode == 0 and whole.ok_line() and "world_size=2" in whole.output, whole.output
    assert "data: mnist, 32 train / 33 val samples" in whole.output, whole.output
    assert "[rank 1/2] device cpu: 16 training samples per epoch, 2 steps of 8" in whole.output, whole.output
    assert re.search(r"val acc [\d.]+ \(33 samples\)", whole.output), whole.output
    # Under torchrun, a worker is SIGKILLed from outside once epoch 1's checkpoint is saved. torchrun restarts
    # both; they resume from the newest checkpoint and end where the spawned run ended, bit for bit.
    crashed, killed = launch.kill_a_worker_after(
        SCRIPT, f"saved {tmp_path / 'crashed'}/checkpoint-1.pt", args + ["--out", tmp_path / "crashed"], 300)
    assert killed and crashed.returncode == 0 and crashed.ok_line(), crashed.output
    assert re.search(r"^resumed from .*checkpoint-[12]\.pt after epoch [12]$", crashed.output, re.M), crashed.output
    out = tmp_path / "whole"
    a, b = torch.load(out / "checkpoint-3.pt"), torch.load(tmp_path / "crashed" / "checkpoint-3.pt")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]), "resumed run != uninterrupted run"
    assert all(torch.equal(x["momentum_buffer"], b["optimizer"]["state"][i]["momentum_buffer"])
               for i, x in a["optimizer"]["state"].items())
    # The newest checkpoint is damaged (cut short). The run resumes from the one before and continues a finished
    # run with more epochs, writing epoch 3 over the damaged file; the newest two stay. (A finished run asked again
    # trains nothing: the worker of test_06_trains_as_one_process_would_and_resumes_bit_for_bit checks it.)
    (out / "checkpoint-3.pt").write_bytes((out / "checkpoint-3.pt").read_bytes()[:1000])
    more = launch.torchrun(SCRIPT, 2, args[:-1] + ["4", "--out", out], timeout=300)
    assert more.returncode == 0 and more.ok_line(), more.output
    assert f"warning: {out}/checkpoint-3.pt does not load (" in more.output, more.output
    assert f"resumed from {out}/checkpoint-2.pt after epoch 2" in more.output, more.output
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-3.pt", "checkpoint-4.pt"]
    assert [torch.load(out / f"checkpoint-{e}.pt")["epoch"] for e in (3, 4)] == [3, 4]


@pytest.mark.slow
def test_plain_python_is_one_process_and_sync_bn_explains_itself(mnist_dir):
    res = launch.python(SCRIPT, ["--data-dir", mnist_dir, "--batch-size", "8", "--epochs", "1", "--sync-bn"],
                        timeout=300)
    assert res.returncode == 0 and res.ok_line() and "world_size=1" in res.output, res.output
    assert "data: mnist, 32 train / 33 val samples" in res.output and "GPUs only" in res.output, res.output
