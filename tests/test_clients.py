"""Training code nobody here wrote, with only the DDP class swapped for ManualDDP: Hugging Face's Trainer (through
accelerate), Lightning's Trainer and Lightning Fabric, each bit for bit equal to its own run with PyTorch's DDP
(tests/workers/clients_worker.py). Their packages are test dependencies only (requirements-dev.txt)."""

import importlib.util

import pytest

import launch

# Found, not imported: importing lightning here would cost every collection of the suite 6 s (the workers import it)
pytestmark = pytest.mark.skipif(not all(map(importlib.util.find_spec, ("accelerate", "lightning"))),
                                reason="pip install -r requirements-dev.txt")


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    """The 2- and 3-rank jobs the session runs, each rank forked from one process that imported torch,
    transformers and lightning (8 s a rank otherwise, most of each job)."""
    ranks = [n for n in (2, 3) if f"test_hugging_face_lightning_and_fabric_run_manual_ddp_bit_for_bit[{n}]" in
             launch.chosen(request)]
    out = tmp_path_factory.mktemp("clients")
    return launch.torchrun_forked(
        "tests/workers/clients_worker.py", {n: ["hf", "lightning", "fabric", out / str(n)] for n in ranks},
        preload=("torch", "transformers.trainer", "transformers.models.gpt2.modeling_gpt2", "lightning.pytorch",
                 "lightning.fabric"), timeout=480, device=None)


@pytest.mark.parametrize("ranks", [2, pytest.param(3, marks=pytest.mark.slow)])  # 3 ranks: ~3 s more
def test_hugging_face_lightning_and_fabric_run_manual_ddp_bit_for_bit(jobs, ranks):
    res = jobs[ranks]
    assert not res.timed_out and res.returncode == 0, res.output
    said = res.ok_line()
    assert said and f"on {ranks} ranks" in said, res.output
    for client in ("Hugging Face Trainer", "Lightning Trainer", "Lightning Fabric"):
        assert client in said, res.output
