"""ddp_dropin.ManualDDP (05's DDPCore with DDP's surface) as a drop-in for torch.nn.parallel.DistributedDataParallel:
its arguments, its numbers, its uses."""

import inspect
import sys

import pytest
import torch

import launch
from conftest import load_script


def test_constructor_takes_every_ddp_argument_with_ddp_defaults():
    ours = inspect.signature(load_script("ddp_dropin.py").ManualDDP.__init__).parameters
    theirs = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    missing = [n for n in theirs if n not in ours]
    assert not missing, f"DDP arguments ManualDDP lacks (torch {torch.__version__}): {missing}"
    differ = [n for n, p in theirs.items() if ours[n].default != p.default]
    assert not differ, f"defaults differ from DDP's: {differ}"
    extra = [n for n, p in ours.items() if n not in theirs]
    assert extra == ["verify"] and ours["verify"].kind is inspect.Parameter.KEYWORD_ONLY, extra
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ours.values()), "no **kwargs to hide typos"


@pytest.mark.slow  # 30 s (4 ranks on 2 cores); the quick tier keeps ManualDDP == DDP through test_zoo and test_clients
def test_drop_in_for_ddp_and_bit_identical_on_4_3_and_2_ranks():
    """One launch (each rank imports transformers for a GPT-2: launches are what the suite pays for): the drop-in
    checks on 4 ranks, with subgroups inside, and exact_worker's step-by-step torch.equal against DDP on all 4
    ranks, on a group of 3 and on pairs (the ring's order of summation differs at each size)."""
    res = launch.run(launch.torchrun_cmd("tests/workers/dropin_worker.py", 4), timeout=300)
    assert not res.timed_out and res.returncode == 0, res.output
    assert res.ok_line() and "bit-identical at every step on 4, a group of 3 and 2 ranks" in res.ok_line(), res.output


def test_the_core_comes_first_and_the_drop_in_extends_it():
    """05 opens on DDPCore, a class of about 200 lines, within its first ~130 lines, and holds no ManualDDP;
    ddp_dropin.py's ManualDDP subclasses 05's DDPCore (loaded, not copied) and overrides the core's methods by
    calling them (four replace a piece); the README states the core's real size."""
    import ast
    tree = ast.parse((launch.REPO / "05_manual_ddp_gpt2.py").read_text())
    top = {n.name: n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    core = top["DDPCore"]
    size = core.end_lineno - core.lineno + 1
    assert core.lineno <= 130 and size <= 220, (core.lineno, size)
    assert "ManualDDP" not in top and "ddp_dropin.py" in ast.get_docstring(tree)
    dropin = ast.parse((launch.REPO / "ddp_dropin.py").read_text())
    manual = next(n for n in dropin.body if isinstance(n, ast.ClassDef) and n.name == "ManualDDP")
    assert [b.id for b in manual.bases] == ["DDPCore", "Joinable"]
    assert not any(isinstance(n, ast.ClassDef) and n.name == "DDPCore" for n in dropin.body), "the core is copied"
    assert load_script("ddp_dropin.py").DDPCore is sys.modules["manual_ddp_gpt2"].DDPCore
    core_methods = {n.name for n in core.body if isinstance(n, ast.FunctionDef)}
    swapped = set()
    for method in manual.body:
        if isinstance(method, ast.FunctionDef) and method.name in core_methods and method.name != "__init__":
            calls_super = any(isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id == "super"
                              for c in ast.walk(method))
            if not calls_super:
                swapped.add(method.name)
    assert swapped == {"buffers_to_sync", "_sync_module_states", "_grads_into_buckets", "_wait"}, swapped
    assert f"the {size}-line class" in (launch.REPO / "README.md").read_text()
