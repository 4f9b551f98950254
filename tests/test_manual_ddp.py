"""05's ManualDDP as a drop-in for torch.nn.parallel.DistributedDataParallel: its arguments, its numbers, its uses."""

import inspect

import pytest
import torch

import launch
from conftest import load_script


def test_constructor_takes_every_ddp_argument_with_ddp_defaults():
    ours = inspect.signature(load_script("05_manual_ddp_gpt2.py").ManualDDP.__init__).parameters
    theirs = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    missing = [n for n in theirs if n not in ours]
    assert not missing, f"DDP arguments ManualDDP lacks (torch {torch.__version__}): {missing}"
    differ = [n for n, p in theirs.items() if ours[n].default != p.default]
    assert not differ, f"defaults differ from DDP's: {differ}"
    extra = [n for n, p in ours.items() if n not in theirs]
    assert extra == ["verify"] and ours["verify"].kind is inspect.Parameter.KEYWORD_ONLY, extra
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ours.values()), "no **kwargs to hide typos"


def test_bit_identical_to_ddp_at_every_step_on_4_ranks():
    res = launch.run(launch.torchrun_cmd("tests/workers/exact_worker.py", 4), timeout=240)
    assert not res.timed_out and res.returncode == 0 and res.ok_line(), res.output


@pytest.mark.parametrize("nproc", [2, 3])
def test_drop_in_for_ddp(nproc):
    """On 3 ranks the same launch also runs exact_worker's checks: bit-identical to DDP at every step."""
    res = launch.run(launch.torchrun_cmd("tests/workers/dropin_worker.py", nproc), timeout=300)
    assert not res.timed_out and res.returncode == 0 and res.ok_line(), res.output
