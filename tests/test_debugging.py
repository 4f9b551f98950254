"""09_debugging.py (issue #38): every scenario on 2 and 3 ranks ends within its timeout with its diagnosis and OK;
check_replicas finds a difference in a parameter, a buffer, a frozen parameter and one bf16 ulp, and says the same
on every rank; the find-the-bug rung fails as shipped and passes once fixed.

One launch per number of ranks runs all five CPU scenarios (each starts its own child jobs); the two launches run
side by side; check_replicas' cases share one launch per number of ranks.
"""

import json
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

import launch

SCENARIOS = {  # scenario -> what its output must show: the diagnosis, as the tool printed it
    "mismatch": ["rank 0 runs ALLREDUCE of shape [3]", "runs ALLREDUCE of shape [2]", "OK mismatch"],
    "rank0-only": ["Timed out waiting 8000ms", "COLLECTIVE_TYPE_MISMATCH", "'barrier'", "OK rank0-only"],
    "uneven": ["4 batches done", "COLLECTIVE_TYPE_MISMATCH", "with PyTorch's DDP", "with ManualDDP", "OK uneven"],
    "drift": ["differ: 0.weight", "differ: 1.running_mean", "check_replicas is quiet", "OK drift"],
    "crash": ["FloatingPointError: loss is nan at step 2", "OK crash"],
    "same-gpu": ["skipped: the ranks are on the CPU"],  # NCCL's lesson: the GPU tier runs it (test_gpu.py)
}


@pytest.mark.slow
def test_every_scenario_shows_its_symptom_its_diagnosis_and_its_fix_on_2_and_3_ranks():
    # Both launches at once: most of a scenario is waiting (a child job's --timeout-s), which the other fills.
    with ThreadPoolExecutor(2) as pool:
        runs = dict(zip([2, 3], pool.map(lambda n: launch.torchrun("09_debugging.py", n, ["--fault", "all"],
                                                                   timeout=900), [2, 3])))
    for nproc, res in runs.items():
        assert not res.timed_out and res.returncode == 0, f"{nproc} ranks\n{res.output[-6000:]}"
        for scenario, shown in SCENARIOS.items():
            for text in shown:
                assert text in res.output, f"{scenario} on {nproc} ranks: no {text!r}\n{res.output[-6000:]}"
        assert f"OK crash: torchrun named rank {nproc - 1}, @record put its FloatingPointError first" in res.output


@pytest.mark.parametrize("nproc", [2, 3])
def test_check_replicas_names_the_tensor_the_ranks_and_the_difference_on_every_rank(nproc):
    res = launch.torchrun("tests/workers/replicas_worker.py", nproc, timeout=240, device=None)
    assert not res.timed_out and res.returncode == 0, res.output[-4000:]
    assert res.ok_line() == f"OK check_replicas on {nproc} ranks: 6 cases", res.output[-4000:]


def test_a_scenario_needs_two_ranks_and_a_known_name():
    res = launch.python("09_debugging.py", ["--fault", "drift"], timeout=120)
    assert res.returncode == 2 and "error: 09 needs 2 or more ranks" in res.output, res.output
    res = launch.python("09_debugging.py", ["--fault", "nope"], timeout=120)
    assert res.returncode == 2 and "error: argument --fault" in res.output, res.output


def test_find_the_bug_fails_as_shipped_and_passes_once_fixed(tmp_path):
    verdicts = tmp_path / "v.json"
    res = launch.run([sys.executable, "exercises/check.py", "find_the_bug", "--file", "exercises/find_the_bug.py",
                      "--file", "tests/exercise_solutions/find_the_bug.py", "--json", str(verdicts)], timeout=300)
    assert not res.timed_out, res.output
    shipped, fixed = json.loads(verdicts.read_text())
    assert shipped["status"] == "fail" and "replicas differ" in shipped["text"], res.output
    assert fixed["status"] == "ok", res.output
