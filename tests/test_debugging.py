"""09_debugging.py and debug_tools.py (issues #38, #46).

09: every scenario on 2 ranks, and all but mismatch on 3 (its two child jobs on 4 processes cost the most and show
nothing new on 3), ends within its timeout with its diagnosis and OK, printing the commands it ran.
debug_tools, on a reader's own training loop (tests/workers/buggy_train.py, not written like 09) on 2 and 3 ranks:
`stacks` finds every rank of a torchrun job from the agent's pid or a rank's, and names the rank that waits in
PyTorch's DDP backward (the reducer, with --native) and the rank alone in an evaluation's gather; flight_recorder's
records, read by `fr`, show rank 0 alone in that gather; check_replicas names a per-rank seed's tensors and a plain
tensor attribute that PyTorch's DDP never broadcasts. check_replicas' own cases (tests/workers/check_replicas_worker.py:
quiet on DDP and ManualDDP after a step, each kind of difference named) on 2 and 3 ranks; the find-the-bug rung
fails as shipped and passes once fixed.

Launches with the same purpose run side by side: most of a hang test is waiting, which the other fills.
"""

import json
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import launch

SCENARIOS = {  # scenario -> what its output must show: the diagnosis, as the tool printed it
    "mismatch": ["rank 0 runs ALLREDUCE of shape [3]", "runs ALLREDUCE of shape [2]",
                 "] all-reduced ['loss', 'samples']",
                 "Exception raised from", "$ TORCH_DISTRIBUTED_DEBUG=DETAIL TORCH_SHOW_CPP_STACKTRACES=1 python -m "
                 "torch.distributed.run --standalone", "OK mismatch"],
    "rank0-only": ["rank 0: program (09_debugging.py:", "rank(s) [0]: gloo:barrier [] from program (09_debugging.py:",
                   "error msg: Culprit rank", "failed to pass monitoredBarrier", "$ python debug_tools.py fr ",
                   "OK rank0-only"],
    "uneven": ["in Tensor.backward <- c10d::Reducer::finalize_backward", "$ python debug_tools.py stacks ",
               "TORCH_DISTRIBUTED_DEBUG=DETAIL on it", "with PyTorch's DDP", "with ManualDDP", "OK uneven"],
    "drift": ["| 0.weight (float32, (16, 8)) on rank(s)", "| 1.running_mean (float32, (16,)) on rank(s)",
              "check_replicas says replicas identical", "OK drift"],
    "crash": ["FloatingPointError: loss is nan at step 2", "OK crash"],
    "same-gpu": ["skipped: the ranks are on the CPU"],  # NCCL's lesson: the GPU tier runs it (test_gpu.py)
}


@pytest.mark.slow
def test_every_scenario_shows_its_symptom_its_diagnosis_and_its_fix_on_2_and_3_ranks():
    faults = {2: list(SCENARIOS), 3: [f for f in SCENARIOS if f != "mismatch"]}
    with ThreadPoolExecutor(2) as pool:
        runs = dict(zip([2, 3], pool.map(lambda n: launch.torchrun("09_debugging.py", n, ["--fault", *faults[n]],
                                                                   timeout=900), [2, 3])))
    for nproc, res in runs.items():
        assert not res.timed_out and res.returncode == 0, f"{nproc} ranks\n{res.output[-6000:]}"
        for scenario in faults[nproc]:
            for text in SCENARIOS[scenario]:
                assert text in res.output, f"{scenario} on {nproc} ranks: no {text!r}\n{res.output[-6000:]}"
        last = nproc - 1
        assert re.search(rf"rank {last}: step \(09_debugging.py:\d+\) in Tensor.backward <- c10d::Reducer", res.output)
        assert all(re.search(rf"rank {r}: program \(09_debugging.py:\d+\) in barrier", res.output) for r in range(last))
        assert f"OK crash: the log and torchrun named rank {last}, @record put its FloatingPointError" in res.output


def test_check_replicas_names_the_tensor_the_ranks_and_the_difference_on_every_rank():
    with ThreadPoolExecutor(2) as pool:
        runs = dict(zip([2, 3], pool.map(lambda n: launch.torchrun("tests/workers/check_replicas_worker.py", n,
                                                                   timeout=300, device=None), [2, 3])))
    for nproc, res in runs.items():
        assert not res.timed_out and res.returncode == 0, res.output[-4000:]
        assert res.ok_line() == f"OK check_replicas on {nproc} ranks: 22 cases", res.output[-4000:]


def test_a_scenario_needs_two_ranks_a_known_name_and_broken_one_scenario():
    res = launch.python("09_debugging.py", ["--fault", "drift"], timeout=120)
    assert res.returncode == 2 and "error: 09 needs 2 or more ranks" in res.output, res.output
    res = launch.python("09_debugging.py", ["--fault", "nope"], timeout=120)
    assert res.returncode == 2 and "error: argument --fault" in res.output, res.output
    res = launch.python("09_debugging.py", ["--broken"], timeout=120)
    assert res.returncode == 2 and "error: --broken runs one scenario's program" in res.output, res.output


def test_find_the_bug_fails_as_shipped_and_passes_once_fixed(tmp_path):
    verdicts = tmp_path / "v.json"
    res = launch.run([sys.executable, "exercises/check.py", "find_the_bug", "--file", "exercises/find_the_bug.py",
                      "--file", "tests/exercise_solutions/find_the_bug.py", "--json", str(verdicts)], timeout=300)
    assert not res.timed_out, res.output
    shipped, fixed = json.loads(verdicts.read_text())
    assert shipped["status"] == "fail" and "replicas differ" in shipped["text"], res.output
    assert fixed["status"] == "ok", res.output


# --- debug_tools on a reader's own job ---
WORKER = "tests/workers/buggy_train.py"


def tool(*argv):
    """`python debug_tools.py ARGV`, as the reader runs it from a shell; returns what it printed."""
    res = subprocess.run([sys.executable, "debug_tools.py", *argv], cwd=launch.REPO, capture_output=True, text=True,
                         timeout=240)
    return res.stdout + res.stderr


def reader_job(nproc, args, until, then, timeout=300):
    """Run the reader's script under torchrun (debug_tools importable through PYTHONPATH, as a reader who keeps it
    elsewhere would); once until(output, folder) holds, call then(agent_pid, pids by rank, folder), stop the whole
    job and return (output, what `then` returned). `folder`: a fresh directory, `{dir}` in args."""
    with tempfile.TemporaryDirectory() as d:
        log = Path(d, "log")
        cmd = launch.torchrun_cmd(WORKER, nproc, [a.replace("{dir}", d) for a in args])
        with open(log, "w") as f:  # a file, not a pipe: the ranks never block on us
            proc = subprocess.Popen(cmd, cwd=launch.REPO, env=launch.make_env(PYTHONPATH=launch.REPO), stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        t0, result = time.time(), None
        try:
            while proc.poll() is None and time.time() - t0 < timeout:
                time.sleep(0.3)
                if until(log.read_text(), d):
                    time.sleep(1)  # the ranks are blocked now
                    result = then(proc.pid, dict(re.findall(r"rank (\d+) pid (\d+)", log.read_text())), d)
                    break
        finally:
            launch.kill_tree(proc)
        return log.read_text(), result


def where(stacks, rank):
    """`stacks`' last line for `rank`: where it waits."""
    return next((ln for ln in stacks.splitlines() if ln.startswith(f"  rank {rank}: ")), f"(no line for {rank})")


def uneven(nproc):
    """Rank 0 has a batch more: it waits in loss.backward() (DDP's reducer), the others in the barrier after the
    loop. `stacks` from torchrun's pid with --native, and from the last rank's pid."""
    return reader_job(nproc, ["--bug", "uneven", "--ddp", "--epochs", "1", "--timeout", "600"],
                      until=lambda out, d: out.count("training done") == nproc - 1,
                      then=lambda agent, pids, d: (tool("stacks", str(agent), "--native"),
                                                   tool("stacks", pids[str(nproc - 1)])))


def eval_gather(nproc):
    """Rank 0 evaluates after epoch 0 and all-gathers; the others are already in epoch 1's DDP backward. Every rank's
    flight_recorder writes its record after a 3 s wait; then `stacks` from rank 1's pid, and `fr`."""
    return reader_job(nproc, ["--bug", "eval-gather", "--ddp", "--timeout", "600", "--record", "{dir}/fr"],
                      until=lambda out, d: len(list(Path(d, "fr").glob("rank_[0-9]*"))) == nproc,
                      then=lambda agent, pids, d: (tool("stacks", pids["1"]), tool("fr", f"{d}/fr")))


@pytest.mark.slow
def test_stacks_and_the_flight_recorder_find_each_hang_of_a_readers_ddp_job_on_2_and_3_ranks():
    # All four jobs at once: a hang test is mostly waiting, which the others fill.
    jobs = [(bug, nproc) for bug in (uneven, eval_gather) for nproc in (2, 3)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = dict(zip(jobs, pool.map(lambda job: job[0](job[1]), jobs)))
    for (bug, nproc), (out, found) in results.items():
        assert found, f"{bug.__name__} on {nproc} ranks: the job never hung as planned\n{out[-3000:]}"
    for nproc in (2, 3):
        native, plain = results[uneven, nproc][1]
        for stacks in (native, plain):  # every rank found, from the agent and from a rank, each where it waits
            assert f"{nproc} rank(s) of {nproc} on this machine: rank 0 pid" in stacks, stacks
            assert re.search(r"train \(buggy_train.py:\d+\) in Tensor.backward", where(stacks, 0)), stacks
            for r in range(1, nproc):
                assert f"== rank {r} (pid" in stacks and re.search(r"train \(buggy_train.py:\d+\) in barrier",
                                                                    where(stacks, r)), stacks
        assert where(native, 0).endswith("<- c10d::Reducer::finalize_backward"), native
        assert "c10d::Reducer::finalize_backward" not in plain, plain  # Python frames only without --native

        stacks, fr = results[eval_gather, nproc][1]
        assert re.search(r"evaluate \(buggy_train.py:\d+\) in all_gather", where(stacks, 0)), stacks
        for r in range(1, nproc):
            assert re.search(r"train \(buggy_train.py:\d+\) in Tensor.backward", where(stacks, r)), stacks
        assert re.search(r"rank\(s\) \[0\]: gloo:all_gather \[\[8, 1\]\] from evaluate \(buggy_train.py:\d+\)", fr), fr
        assert f"rank(s) {list(range(1, nproc))}: gloo:all_reduce" in fr, fr
        assert "'Culprit rank R' means that R's call differs" in fr, fr


@pytest.mark.slow
def test_check_replicas_finds_a_per_rank_seed_and_a_tensor_attribute_that_ddp_never_broadcasts():
    """torch.manual_seed(rank) before the model: averaged by hand, every tensor differs; under PyTorch's DDP, which
    broadcasts parameters and buffers, only the plain tensor attribute `proj` does (an ordinary DDP loop's quiet
    verdict, optimizer state included: check_replicas_worker)."""
    runs = [(2, ["--bug", "seed"]), (3, ["--bug", "seed", "--ddp"])]
    with ThreadPoolExecutor(len(runs)) as pool:
        results = list(pool.map(lambda run: launch.torchrun(WORKER, run[0], [*run[1], "--check", "--epochs", "1"],
                                                            timeout=300, device=None, PYTHONPATH=launch.REPO), runs))
    hand, ddp = (res.output for res in results)
    assert "RuntimeError: replicas differ in 5 places (parameters 4, tensor attributes 1)" in hand, hand[-3000:]
    assert "\n  fc1.weight (float32, (32, 16)) on rank(s) [1] differs" in hand, hand[-3000:]
    assert "\n  proj (float32, (16, 16)) on rank(s) [1] differs" in hand, hand[-3000:]
    message = re.search(r"RuntimeError: (replicas differ: .*)", ddp)
    assert message and message.group(1).startswith("replicas differ: module.proj (float32, (16, 16)) on rank(s) "
                                                   "[1, 2] differs from rank 0's by up to"), ddp[-3000:]
    assert "fc1" not in message.group(1), message.group(1)  # DDP's broadcast made the parameters equal
