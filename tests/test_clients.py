"""Training code nobody here wrote, with only the DDP class swapped for ManualDDP: Hugging Face's Trainer (through
accelerate) and Lightning's Trainer, each bit for bit equal to its own run with PyTorch's DDP (tests/workers/
clients_worker.py). Their packages are test dependencies only (requirements-dev.txt)."""

import pytest

import launch

pytest.importorskip("accelerate", reason="pip install -r requirements-dev.txt")
pytest.importorskip("lightning", reason="pip install -r requirements-dev.txt")


@pytest.mark.parametrize("ranks", [2, 3])
def test_hugging_face_and_lightning_trainers_run_manual_ddp_bit_for_bit(tmp_path, ranks):
    res = launch.run(launch.torchrun_cmd("tests/workers/clients_worker.py", ranks, ["hf", "lightning", tmp_path]),
                     timeout=240)
    assert not res.timed_out and res.returncode == 0, res.output
    assert res.ok_line() and "Hugging Face Trainer" in res.ok_line() and "Lightning" in res.ok_line(), res.output
    assert f"on {ranks} ranks" in res.ok_line(), res.output
