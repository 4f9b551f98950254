"""The setup block every numbered script shares: identical in each, and its device choice over the whole table."""

import argparse
import re

import pytest
import torch

from conftest import REPO, load_script

SCRIPTS = sorted(p.name for p in REPO.glob("0[0-9]_*.py"))


def setup_block(name):
    text = (REPO / name).read_text()
    # The lesson comes first: the block is the last thing before the `if __name__ == "__main__":` line.
    return re.search(r"^# --- distributed setup.*?(?=^if __name__ == \"__main__\":)", text, re.S | re.M).group(0)


def test_every_script_has_the_same_setup_block():
    blocks = {name: setup_block(name) for name in SCRIPTS}
    first = blocks[SCRIPTS[0]]
    assert len(SCRIPTS) >= 6 and "def choose_device" in first and "def setup" in first
    assert [n for n, b in blocks.items() if b != first] == [], "the setup block differs; copy it unchanged"


def test_05_06_08_share_one_checkpoint_block():
    """One checkpoint contract for every --out: the same code, copied."""
    blocks = {name: re.search(r"^# --- checkpoints: the same block.*?(?=^# --- )", (REPO / name).read_text(),
                              re.S | re.M).group(0) for name in ("05_manual_ddp_gpt2.py", "06_torch_ddp_resnet.py",
                                                                 "08_fsdp.py")}
    assert len(set(blocks.values())) == 1 and "def claim" in blocks["08_fsdp.py"], "copy the checkpoint block"


# (--device, --backend, GPUs on the node, local world size, local rank) -> (device, backend, note says) or error says
TABLE = [
    (("auto", None, 0, 2, 1), ("cpu", "gloo", None)),
    (("auto", "gloo", 0, 2, 1), ("cpu", "gloo", None)),
    (("auto", "nccl", 0, 2, 1), "nccl runs on CUDA GPUs only"),
    (("auto", None, 1, 1, 0), ("cuda:0", "nccl", None)),
    (("auto", None, 2, 2, 1), ("cuda:1", "nccl", None)),
    (("auto", None, 8, 2, 1), ("cuda:1", "nccl", None)),
    (("auto", "gloo", 2, 2, 1), ("cuda:1", "gloo", None)),
    (("auto", "nccl", 2, 2, 1), ("cuda:1", "nccl", None)),
    (("auto", None, 1, 2, 1), ("cpu", "gloo", "--device cuda --backend gloo")),
    (("auto", "gloo", 2, 3, 2), ("cpu", "gloo", "--nproc_per_node=2")),
    (("auto", "nccl", 1, 2, 1), "nccl needs one GPU per rank"),
    (("cpu", None, 0, 2, 1), ("cpu", "gloo", None)),
    (("cpu", None, 4, 2, 1), ("cpu", "gloo", None)),
    (("cpu", "gloo", 4, 2, 1), ("cpu", "gloo", None)),
    (("cpu", "nccl", 4, 2, 1), "nccl runs on CUDA GPUs only"),
    (("cuda", None, 0, 1, 0), "no CUDA GPU"),
    (("cuda", "gloo", 0, 2, 1), "no CUDA GPU"),
    (("cuda", "nccl", 0, 2, 1), "no CUDA GPU"),
    (("cuda", None, 1, 1, 0), ("cuda:0", "nccl", None)),
    (("cuda", None, 2, 2, 1), ("cuda:1", "nccl", None)),
    (("cuda", "gloo", 2, 2, 1), ("cuda:1", "gloo", None)),
    (("cuda", "nccl", 2, 2, 1), ("cuda:1", "nccl", None)),
    (("cuda", None, 1, 2, 1), ("cuda:0", "gloo", "2 ranks share 1 GPU(s) over gloo")),
    (("cuda", "gloo", 1, 3, 2), ("cuda:0", "gloo", "3 ranks share 1 GPU(s)")),
    (("cuda", "gloo", 2, 3, 2), ("cuda:0", "gloo", "3 ranks share 2 GPU(s)")),
    (("cuda", "gloo", 2, 4, 3), ("cuda:1", "gloo", "4 ranks share 2 GPU(s)")),
    (("cuda", "nccl", 1, 2, 1), "nccl needs one GPU per rank, but this node has 1 for 2 ranks"),
    (("cuda", "nccl", 3, 4, 0), "--nproc_per_node=3"),
]


@pytest.mark.parametrize("given,expected", TABLE, ids=[str(g) for g, _ in TABLE])
def test_device_choice(given, expected):
    lesson = load_script(SCRIPTS[0])  # every script has the same block (checked above)
    device_flag, backend_flag, n_gpus, local_world, local_rank = given
    call = (device_flag, backend_flag, n_gpus, local_rank, local_world)
    if isinstance(expected, str):
        with pytest.raises(lesson.UsageError, match=re.escape(expected)):
            lesson.choose_device(*call)
        return
    device, backend, note = lesson.choose_device(*call)
    assert (str(device), backend) == expected[:2]
    assert (note is None) == (expected[2] is None) and (expected[2] is None or expected[2] in note), note


def test_cpu_path_never_asks_cuda(monkeypatch):
    """--device cpu decides without touching CUDA, and a process group of one runs without torchrun."""
    def refuse(*args):
        pytest.fail("torch.cuda was asked on the CPU path")
    for name in ("device_count", "is_available", "set_device"):
        monkeypatch.setattr(torch.cuda, name, refuse)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    lesson = load_script("05_manual_ddp_gpt2.py")
    args = argparse.Namespace(device="cpu", backend=None, timeout_s=30)
    try:
        assert str(lesson.setup(args, min_world=1)) == "cpu"
        assert torch.distributed.get_backend() == "gloo" and torch.distributed.get_world_size() == 1
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_gpu_tiers_flags_parse_here(name, monkeypatch):
    """The GPU tier runs where CUDA is, rarely: its flags for each script are checked here, on every machine, with
    the script's own parser (the device flags that tier adds are the setup block's, checked above)."""
    from test_gpu import ARGS
    monkeypatch.setattr("sys.argv", [name, *ARGS[name]])
    load_script(name).parse_args()
