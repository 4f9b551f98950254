"""Training code nobody here wrote, with only the DDP class swapped for ManualDDP: Hugging Face's Trainer (through
accelerate), Lightning's Trainer and Lightning Fabric, each bit for bit equal to its own run with PyTorch's DDP
(tests/workers/clients_worker.py). Their packages are test dependencies only (requirements-dev.txt)."""

import pytest

import launch

pytest.importorskip("accelerate", reason="pip install -r requirements-dev.txt")
pytest.importorskip("lightning", reason="pip install -r requirements-dev.txt")


@pytest.mark.parametrize("ranks", [2, pytest.param(3, marks=pytest.mark.slow)])  # 3 ranks: ~15 s more
def test_hugging_face_lightning_and_fabric_run_manual_ddp_bit_for_bit(tmp_path, ranks):
    clients = ["hf", "lightning", "fabric"]
    res = launch.run(launch.torchrun_cmd("tests/workers/clients_worker.py", ranks, [*clients, tmp_path]), timeout=240)
    assert not res.timed_out and res.returncode == 0, res.output
    said = res.ok_line()
    assert said and f"on {ranks} ranks" in said, res.output
    for client in ("Hugging Face Trainer", "Lightning Trainer", "Lightning Fabric"):
        assert client in said, res.output
