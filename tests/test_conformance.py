"""PyTorch's own DDP tests, run on ManualDDP: a representative handful (ddp_conformance.py runs them all).

The tests come from the suite the torch wheel ships (torch/testing/_internal/distributed/distributed_test.py), run
as test/distributed/test_distributed_spawn.py runs them (gloo, one process per rank), with DistributedDataParallel
replaced by 05's ManualDDP in every rank; here the ranks are forked from the process that imported the suite
(--fork), not spawned to import torch and the suite again (4 s a test on 2 cores, for a test of 0.3 s): the same test
methods run in them. Most of that suite's DDP tests ask for a GPU per rank; --gpu-tests-on-cpu runs them on the CPU
(each one below passes that way on PyTorch's DDP too). One launch of the conformance script runs them all; each test
here reads its verdict.
"""

import importlib.util
import json
import sys

import pytest

import launch

# Each passes on PyTorch's DDP and uses only DDP's public API: what a drop-in must get right. Four, for the suite's
# time (~4 s of importing and picking the suite's tests, then each forks its ranks anew): all 50 that pass
# on DDP run in ddp_conformance.py's full run (docs/manual_ddp.md has its table; run it after changing
# ManualDDP, as the note of each such change says).
CHOSEN = {
    "test_ddp_create_graph": "double backward (create_graph=True) through the wrapper, gradients as in one process",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook": "no_sync accumulation, then a comm hook whose "
                                                                  "future is chained with then()",
    "test_ddp_join_model_equivalence": "join() with uneven inputs: the model ends as one trained on all the data",
    "test_different_graph_across_ranks": "find_unused_parameters / static_graph with a different graph per rank",
}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("expecttest") is None,
                       reason="PyTorch's distributed test suite imports expecttest: pip install expecttest"),
]


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    out = tmp_path_factory.mktemp("conformance")
    names = list(CHOSEN)
    cmd = [sys.executable, "ddp_conformance.py", "--impl", "manual", "--world-size", "2", "--timeout", "60",
           "--gpu-tests-on-cpu", "--fork", "--out", str(out), "-k", f"^({'|'.join(names)})$"]
    res = launch.run(cmd, timeout=480)  # ~10 s alone; a loaded machine can take ten times that
    assert not res.timed_out, res.output
    lines = [json.loads(ln) for ln in (out / "results_manual_ws2_gpu_tests_on_cpu.jsonl").read_text().splitlines()]
    found = {ev["test"]: ev for ev in lines if ev["event"] == "result"}
    assert set(found) == set(names), res.output
    return found


@pytest.mark.parametrize("name", CHOSEN)
def test_pytorch_ddp_test_passes_on_manual_ddp(verdicts, name):
    ev = verdicts[name]
    assert ev["status"] == "pass", f"{name} ({CHOSEN[name]}): {ev['status']}\n{ev['detail']}"
