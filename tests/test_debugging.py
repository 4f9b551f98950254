"""09_debugging.py and debug_tools.py (issues #38, #46, #52).

09: every scenario on 2 ranks, and uneven's hang on 3 (where the ranks that wait in the barrier are [0, 1]), ends
within its timeout with its diagnosis and OK, printing the commands it ran; the 3-rank pass runs under a Python
with no py-spy anywhere it looks, and still diagnoses (without `stacks`). The programs' maths on 3 ranks are
lesson09_worker's.
09's programs in-process on 3 ranks (tests/workers/lesson09_worker.py), by their maths: the naive average is the mean
(one process on every rank's batch), each fixed program issues the same collectives on every rank and ends with
identical replicas, equal to one process's.
debug_tools, on a reader's own training loop (tests/workers/buggy_train.py, not written like 09) on 2 and 3 ranks:
`stacks` finds every rank of a torchrun job and of plain processes a shell started, from the launcher's pid or a
rank's, and names the rank that waits in PyTorch's DDP backward (the reducer, with --native) and the rank alone in an
evaluation's gather; flight_recorder's records, read by `fr`, show rank 0 alone in that gather, and `fr` reads one
run from a folder a bigger run used before; check_replicas names a per-rank seed's tensors and a plain tensor
attribute that PyTorch's DDP never broadcasts. On a job written as PyTorch's DDP tutorial writes one
(tests/workers/spawn_train.py: mp.spawn or torchrun, DataLoader workers, BatchNorm): `stacks` from mp.spawn's parent,
a DataLoader worker, `sleep`, with py-spy beside a venv's python and with none; check_replicas quiet on BatchNorm
under DDP, and on a rank-0-only resume listing the optimizer's state first. check_replicas' own cases
(tests/workers/check_replicas_worker.py) on 2 and 3 ranks; the find-the-bug rung fails as shipped and passes fixed.

Launches with the same purpose run side by side: most of a hang test is waiting, which the other fills. 09's
scenarios run as three jobs at once, alone; the other tests' launches start together once they come (two tests'
at a time, the hangs first), each test asserting on its own.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import launch
from conftest import load_script

SCENARIOS = {  # scenario -> what its output must show: the diagnosis, as the tool printed it
    "mismatch": ["rank 0 runs ALLREDUCE of shape [3]", "runs ALLREDUCE of shape [2]",
                 "] all-reduced ['loss', 'samples']",
                 "Exception raised from", "$ TORCH_DISTRIBUTED_DEBUG=DETAIL TORCH_SHOW_CPP_STACKTRACES=1 python -m "
                 "torch.distributed.run --standalone", "OK mismatch"],
    "rank0-only": ["rank(s) [0]: gloo:barrier [] from program (09_debugging.py:", "error msg: Culprit rank",
                   "failed to pass monitoredBarrier", "$ python debug_tools.py fr ", "OK rank0-only"],
    "uneven": ["TORCH_DISTRIBUTED_DEBUG=DETAIL on it", "with PyTorch's DDP", "with ManualDDP", "OK uneven"],
    "drift": ["| 0.weight (float32, (16, 8)) on rank(s)", "| 1.running_mean (float32, (16,)) on rank(s)",
              "check_replicas says replicas identical", "OK drift"],
    "crash": ["FloatingPointError: loss is nan at step 2", "OK crash"],
    "same-gpu": ["skipped: the ranks are on the CPU"],  # NCCL's lesson: the GPU tier runs it (test_gpu.py)
}


STACKS = {  # what rank0-only and uneven show with py-spy (on 2 ranks), and what they say without it (uneven on 3)
    True: ["rank 0: program (09_debugging.py:", "$ python debug_tools.py stacks ",
           "in Tensor.backward <- c10d::Reducer::finalize_backward",
           "OK rank0-only: stacks, the Flight Recorder and monitored_barrier each named",
           "OK uneven: stacks (DDP's reducer) and the Flight Recorder found the hang"],
    False: ["(stacks skipped: py-spy not found. pip install py-spy to see every rank's stack.)",
            "OK rank0-only: the Flight Recorder and monitored_barrier (stacks skipped: no py-spy) each named",
            "OK uneven: the Flight Recorder (stacks skipped: no py-spy) found the hang"]}


@pytest.mark.slow
def test_every_scenario_shows_its_symptom_its_diagnosis_and_its_fix_on_2_and_3_ranks(tmp_path):
    """2 ranks with py-spy; 3 ranks under a Python that has none beside it and a PATH without it (a virtual
    environment over this one, not activated): stacks skipped, said, and uneven's hang still diagnosed."""
    hangs = ["rank0-only", "uneven"]
    jobs = {"2 ranks": (2, [f for f in SCENARIOS if f not in hangs]), "2 ranks, hangs": (2, hangs),
            "3 ranks": (3, ["uneven"])}  # on 3 ranks, the ranks waiting in the barrier are [0, 1]
    python, path = venv_python(tmp_path)

    def run(name):
        nproc, faults = jobs[name]
        cmd = launch.torchrun_cmd("09_debugging.py", nproc, ["--fault", *faults, "--device", "cpu"])
        if nproc == 3:
            return launch.run([python, *cmd[1:]], timeout=900, env=launch.make_env(PATH=path))
        return launch.run(cmd, timeout=900)
    # three jobs at once: each waits for its child jobs' startups and timeouts, which the others fill
    with ThreadPoolExecutor(3) as pool:
        done = dict(zip(jobs, pool.map(run, jobs)))
    for name, res in done.items():
        assert not res.timed_out and res.returncode == 0, f"{name}\n{res.output[-6000:]}"
    faults = {2: list(SCENARIOS), 3: jobs["3 ranks"][1]}
    runs = {2: launch.Result(0, done["2 ranks"].output + done["2 ranks, hangs"].output, False), 3: done["3 ranks"]}
    for nproc, res in runs.items():
        for scenario in faults[nproc]:
            for text in SCENARIOS[scenario]:
                assert text in res.output, f"{scenario} on {nproc} ranks: no {text!r}\n{res.output[-6000:]}"
        for text in STACKS[nproc == 2]:
            if nproc == 2 or "rank0-only" not in text:
                assert text in res.output, f"{nproc} ranks: no {text!r}\n{res.output[-6000:]}"
        last = nproc - 1  # uneven: the ranks out of data wait in the barrier, the last in DDP's all-reduce
        assert f"rank(s) {list(range(last))}: gloo:barrier [] from program (09_debugging.py:" in res.output
        assert f"rank(s) [{last}]: gloo:all_reduce" in res.output
    assert "OK crash: the log and torchrun named rank 1, @record put its FloatingPointError" in runs[2].output
    two = runs[2].output
    assert re.search(r"rank 1: step \(09_debugging.py:\d+\) in Tensor.backward <- c10d::Reducer", two), two[-6000:]
    assert re.search(r"rank 0: program \(09_debugging.py:\d+\) in barrier", two), two[-6000:]
    assert "stacks skipped" not in two and "$ python debug_tools.py stacks " not in runs[3].output


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """{test name: what its launches returned}, launched ahead: the hangs first, the one-process runs beside them."""
    jobs = {"test_stacks_and_the_flight_recorder_find_each_hang_of_a_readers_ddp_job_on_2_and_3_ranks": hangs,
            "test_a_scenario_needs_two_ranks_a_known_name_and_broken_one_scenario": usage_errors,
            "test_find_the_bug_fails_as_shipped_and_passes_once_fixed": find_the_bug,
            "test_debug_tools_on_a_job_launched_by_mp_spawn_or_torchrun_with_dataloader_workers": spawned_jobs,
            "test_check_replicas_finds_a_per_rank_seed_and_a_tensor_attribute_that_ddp_never_broadcasts": seeded,
            "test_check_replicas_names_the_tensor_the_ranks_and_the_difference_on_every_rank": replicas_cases,
            "test_09s_average_is_the_mean_and_each_fix_fixes_on_3_ranks": lesson09}
    with launch.ahead(request, {name: lambda f=f: f(tmp_path_factory.mktemp("job")) for name, f in jobs.items()}) \
            as futures:
        yield futures


def replicas_cases(_):  # the ranks of both jobs forked from one process that imported torch
    return launch.torchrun_forked("tests/workers/check_replicas_worker.py", {2: [], 3: []}, timeout=300, device=None)


def test_check_replicas_names_the_tensor_the_ranks_and_the_difference_on_every_rank(launched, request):
    runs = launched[request.node.name].result()
    for nproc, res in runs.items():
        assert not res.timed_out and res.returncode == 0, res.output[-4000:]
        assert res.ok_line() == f"OK check_replicas on {nproc} ranks: {22 + (nproc > 2)} cases", res.output[-4000:]


def lesson09(_):
    return launch.torchrun_forked("tests/workers/lesson09_worker.py", {3: []}, timeout=300, device=None)[3]


def test_09s_average_is_the_mean_and_each_fix_fixes_on_3_ranks(launched, request):
    """09's programs in-process, checked by their maths, not by their output (issue #63). The naive average
    equals one process on every rank's batch, and so do drift's fix and the fixed programs. Each fixed program
    issues the same collectives on every rank (uneven's under Join too) and ends with identical replicas."""
    res = launched[request.node.name].result()
    assert not res.timed_out and res.returncode == 0, res.output[-4000:]
    assert res.ok_line() == "OK 09's programs on 3 ranks", res.output[-4000:]


def test_a_missing_diagnosis_ends_09_with_one_fail_line_and_exit_1(group_of_one, capsys):
    """09's verdict is its own self-check: a diagnosis that did not appear must end the run."""
    debugging = load_script("09_debugging.py")
    debugging.diagnosed(True, "not printed")
    with pytest.raises(SystemExit) as stopped:
        debugging.diagnosed(False, "DETAIL did not report both shapes")
    assert stopped.value.code == 1 and capsys.readouterr().out == "FAIL: DETAIL did not report both shapes\n"


def test_fr_names_the_first_collective_at_which_the_ranks_part_and_your_line_in_it():
    """`fr`'s summary of records made by hand: the ranks agree on #1 and part at #2, where rank 1 waits in a barrier
    while rank 0, past it, reached #3. Each call is named by the innermost frame of the reader's code."""
    import debug_tools

    def entry(seq, name, line):  # the Flight Recorder's fields that fr reads; frames innermost first
        frames = [{"filename": "/venv/lib/python3.11/site-packages/torch/distributed/c10d.py", "name": name,
                   "line": 1}, {"filename": "/home/me/train.py", "name": "train", "line": line},
                  {"filename": "/home/me/train.py", "name": "<module>", "line": 99}]
        return {"collective_seq_id": seq, "profiling_name": f"gloo:{name}", "input_sizes": [[4]],
                "process_group": ("0", "default"), "frames": frames}
    records = {0: {"entries": [entry(1, "all_reduce", 10), entry(2, "all_reduce", 11), entry(3, "all_reduce", 12)],
                   "pg_status": {"0": {"last_completed_collective": 2}}},
               1: {"entries": [entry(1, "all_reduce", 10), entry(2, "barrier", 20)],
                   "pg_status": {"0": {"last_completed_collective": 1}}}}
    assert debug_tools.summarize_records(records) == [
        "rank 0: 3 collectives; the last, #3, gloo:all_reduce [[4]] from train (train.py:12), never completed",
        "rank 1: 2 collectives; the last, #2, gloo:barrier [[4]] from train (train.py:20), never completed",
        "the ranks part at collective #2 of group 0:",
        "  rank(s) [0]: gloo:all_reduce [[4]] from train (train.py:11)",
        "  rank(s) [1]: gloo:barrier [[4]] from train (train.py:20)"]


def usage_errors(_):
    return [launch.python("09_debugging.py", args, timeout=120) for args in (["--fault", "drift"],
                                                                          ["--fault", "nope"], ["--broken"])]


def test_a_scenario_needs_two_ranks_a_known_name_and_broken_one_scenario(launched, request):
    res, nope, broken = launched[request.node.name].result()
    assert res.returncode == 2 and "error: 09 needs 2 or more ranks" in res.output, res.output
    assert nope.returncode == 2 and "error: argument --fault" in nope.output, nope.output
    assert broken.returncode == 2 and "error: --broken runs one scenario's program" in broken.output, broken.output


def find_the_bug(folder):
    verdicts = folder / "v.json"
    return launch.run([sys.executable, "exercises/check.py", "find_the_bug", "--file", "exercises/find_the_bug.py",
                       "--file", "exercises/solutions/find_the_bug.py", "--json", str(verdicts)],
                      timeout=300), verdicts


def test_find_the_bug_fails_as_shipped_and_passes_once_fixed(launched, request):
    res, verdicts = launched[request.node.name].result()
    assert not res.timed_out, res.output
    shipped, fixed = json.loads(verdicts.read_text())
    assert shipped["status"] == "fail" and "replicas differ" in shipped["text"], res.output
    assert fixed["status"] == "ok", res.output


# --- debug_tools on a reader's own job ---
WORKER = "tests/workers/buggy_train.py"


def venv_python(tmp_path, py_spy=False):
    """(python, PATH): a virtual environment over this Python (its packages, torch included), not activated, and a
    PATH without py-spy; py-spy beside the venv's python when asked, else nowhere these two lead."""
    venv = tmp_path / ("venv_py_spy" if py_spy else "venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    # This Python's packages (torch...) for the venv's: a .pth file, which also works when this Python is a venv
    # itself (--system-site-packages would give the base interpreter's packages, not this one's).
    site = next(venv.glob("lib/python3*/site-packages"))
    site.joinpath("outer.pth").write_text("\n".join(p for p in sys.path if p.endswith(("site-packages",
                                                                                         "dist-packages"))) + "\n")
    if py_spy:
        here = Path(sys.executable).resolve().parent / "py-spy"  # the binary itself (shutil.which may find a shim)
        (venv / "bin" / "py-spy").symlink_to(here if here.exists() else shutil.which("py-spy"))
    path = [d for d in ("/usr/local/bin", "/usr/bin", "/bin") if not Path(d, "py-spy").exists()]
    return str(venv / "bin" / "python"), os.pathsep.join(path)


def tool(*argv, python=sys.executable, **env):
    """`python debug_tools.py ARGV`, as the reader runs it from a shell; returns what it printed."""
    res = subprocess.run([python, "debug_tools.py", *argv], cwd=launch.REPO, capture_output=True, text=True,
                         timeout=240, env={**os.environ, **env})
    return res.stdout + res.stderr


def reader_job(nproc, args, until, then, timeout=300, script=WORKER, folder=None, plain=False):
    """Run the reader's script under torchrun (nproc ranks) or as it launches itself (nproc None: mp.spawn), with
    debug_tools importable through PYTHONPATH, as a reader who keeps it elsewhere would; once until(output, folder)
    holds, call then(launcher's pid, pids by rank, folder), stop the whole job and return (output, what `then`
    returned). `folder`: a fresh directory unless given, `{dir}` in args. `plain`: nproc processes started by a shell,
    no torchrun."""
    with tempfile.TemporaryDirectory() as fresh:
        d = folder or fresh
        log = Path(fresh, "log")
        args = [a.replace("{dir}", d) for a in args]
        cmd = launch.torchrun_cmd(script, nproc, args) if nproc else [sys.executable, str(launch.REPO / script), *args]
        if plain:  # nproc processes with torchrun's variables, started by a shell script (as srun or a hand-made
            port = launch.free_port()  # launcher starts them): no agent, the shell their parent
            cmd = ["bash", "-c", " ".join(
                f"RANK={r} LOCAL_RANK={r} WORLD_SIZE={nproc} LOCAL_WORLD_SIZE={nproc} MASTER_ADDR=127.0.0.1 "
                f"MASTER_PORT={port} {shlex.join([sys.executable, str(launch.REPO / script), *args])} &"
                for r in range(nproc)) + " wait"]
        with open(log, "w") as f:  # a file, not a pipe: the ranks never block on us
            proc = subprocess.Popen(cmd, cwd=launch.REPO, env=launch.make_env(PYTHONPATH=launch.REPO), stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        t0, result = time.time(), None
        try:
            while proc.poll() is None and time.time() - t0 < timeout:
                time.sleep(0.3)
                if until(log.read_text(), d):
                    time.sleep(1)  # the ranks are blocked now
                    text = log.read_text()  # 'rank 1 pid 123', and DataLoader workers' 'rank 1 worker 0 pid 124'
                    pids = {**dict(re.findall(r"rank (\d+) pid (\d+)", text)),
                            **{f"{r}.{w}": p for r, w, p in re.findall(r"rank (\d+) worker (\d+) pid (\d+)", text)}}
                    result = then(proc.pid, pids, d)
                    break
        finally:
            launch.kill_tree(proc)
        return log.read_text(), result


def where(stacks, rank):
    """`stacks`' last line for `rank`: where it waits."""
    return next((ln for ln in stacks.splitlines() if ln.startswith(f"  rank {rank}: ")), f"(no line for {rank})")


def uneven(nproc):
    """Rank 0 has a batch more: it waits in loss.backward() (DDP's reducer), the others in the barrier after the
    loop. `stacks` from the launcher's pid with --native, and from the last rank's pid. On 2 ranks the ranks are
    plain processes a shell started (no torchrun), on 3 torchrun's."""
    return reader_job(nproc, ["--bug", "uneven", "--ddp", "--epochs", "1", "--timeout", "600"],
                      until=lambda out, d: out.count("training done") == nproc - 1,
                      then=lambda agent, pids, d: (tool("stacks", str(agent), "--native"),
                                                   tool("stacks", pids[str(nproc - 1)])), plain=nproc == 2)


def eval_gather(nproc, folder):
    """Rank 0 evaluates after epoch 0 and all-gathers; the others are already in epoch 1's DDP backward. Every rank's
    flight_recorder writes its record (into `folder`/fr) after a 3 s wait; then `stacks` from rank 1's pid, and
    `fr`. Only the newest records count: those of this run, whose written time is past those of a run before."""
    t0 = time.time()
    return reader_job(nproc, ["--bug", "eval-gather", "--ddp", "--timeout", "600", "--record", "{dir}/fr"],
                      until=lambda out, d: sum(p.stat().st_mtime > t0 for p in Path(d, "fr").glob("rank_[0-9]*"))
                      == nproc, then=lambda agent, pids, d: (tool("stacks", pids["1"]), tool("fr", f"{d}/fr")),
                      folder=folder)


def hangs(folder):
    def both_eval_gathers(_):
        return eval_gather(3, str(folder)), eval_gather(2, str(folder))
    # Three jobs at once (the two evaluation hangs in turn): a hang test is mostly waiting, which the others fill.
    jobs = [(uneven, 2), (uneven, 3), (both_eval_gathers, None)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = dict(zip(jobs, pool.map(lambda job: job[0](job[1]), jobs)))
    results[eval_gather, 3], results[eval_gather, 2] = results.pop((both_eval_gathers, None))
    return results


@pytest.mark.slow
def test_stacks_and_the_flight_recorder_find_each_hang_of_a_readers_ddp_job_on_2_and_3_ranks(launched, request):
    """The 2-rank evaluation hang records into the folder the 3-rank one used: `fr` reads the 2-rank run alone and
    says it skipped the stale rank_2."""
    results = launched[request.node.name].result()
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
        files = ", ".join(f"rank_{r}" for r in range(nproc))
        assert re.search(rf"^read run \S+ \({nproc} ranks, written [\d:]+\): {files}$", fr, re.M), fr
    stale = results[eval_gather, 2][1][1]
    assert re.search(r"^skipped: rank_2 \(run \S+, 3 ranks, written [\d:]+\)$", stale, re.M), stale
    assert "rank 2" not in stale, stale


def seeded(_):  # the ranks of both jobs forked from one process that imported torch
    runs = launch.torchrun_forked(WORKER, {2: ["--bug", "seed", "--check", "--epochs", "1"],
                                           3: ["--bug", "seed", "--ddp", "--check", "--epochs", "1"]},
                                  timeout=300, device=None, PYTHONPATH=launch.REPO)
    return runs[2], runs[3]


@pytest.mark.slow
def test_check_replicas_finds_a_per_rank_seed_and_a_tensor_attribute_that_ddp_never_broadcasts(launched, request):
    """torch.manual_seed(rank) before the model: averaged by hand, every tensor differs; under PyTorch's DDP, which
    broadcasts parameters and buffers, only the plain tensor attribute `proj` does (an ordinary DDP loop's quiet
    verdict, optimizer state included: check_replicas_worker)."""
    hand, ddp = (res.output for res in launched[request.node.name].result())
    assert "ReplicasDiffer: replicas differ in 5 places (parameters 4, tensor attributes 1)" in hand, hand[-3000:]
    assert "]:   fc1.weight (float32, (32, 16)) on rank(s) [1] differs" in hand, hand[-3000:]  # c10d's [rank1]:
    assert "]:   proj (float32, (16, 16)) on rank(s) [1] differs" in hand, hand[-3000:]
    message = re.search(r"ReplicasDiffer: (replicas differ: .*)", ddp)
    assert message and message.group(1).startswith("replicas differ: module.proj (float32, (16, 16)) on rank(s) "
                                                   "[1, 2] differs from rank 0's by up to"), ddp[-3000:]
    assert "fc1" not in message.group(1), message.group(1)  # DDP's broadcast made the parameters equal


# --- debug_tools on a job written as PyTorch's DDP tutorial writes one ---
SPAWN = "tests/workers/spawn_train.py"


def spawned_jobs(folder):
    """test_debug_tools_on_a_job_launched_by_mp_spawn_or_torchrun_with_dataloader_workers's three runs."""
    import torch
    sys.path.insert(0, str(launch.REPO))  # spawn_train imports debug_tools, as the job's own PYTHONPATH has it
    spawn_train = load_script(SPAWN)
    torch.manual_seed(1)  # the checkpoint: one step of the tutorial's model and optimizer
    model = spawn_train.ToyModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model(torch.randn(16, 10)).sum().backward()
    opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, folder / "ckpt.pt")
    hidden, path = venv_python(folder)
    beside, _ = venv_python(folder, py_spy=True)

    def spawned(launcher, pids, d):
        with subprocess.Popen(["sleep", "60"]) as sleep:
            not_a_rank = tool("stacks", str(sleep.pid))
            sleep.kill()
        return pids, {"launcher": tool("stacks", str(launcher)), "worker": tool("stacks", pids["1.0"]),
                      "sleep": not_a_rank, "beside": tool("stacks", pids["1"], python=beside, PATH=path),
                      "hidden": tool("stacks", str(launcher), python=hidden, PATH=path)}

    def hung(out, d):  # rank 0 in its barrier, rank 1 past step 1, both ranks' workers up
        return "rank 0 step 1 " in out and "rank 1 step 1 " in out and len(re.findall(r" worker \d pid ", out)) == 4
    runs = {"mp.spawn": lambda: reader_job(None, ["--bug", "rank0-barrier", "--port", str(launch.free_port())],
                                           hung, spawned, script=SPAWN),
            "torchrun": lambda: reader_job(2, ["--bug", "rank0-barrier"], hung, lambda launcher, pids, d:
                                           (pids, {"worker": tool("stacks", pids["0.1"])}), script=SPAWN),
            "resume": lambda: launch.run([sys.executable, SPAWN, "--bug", "resume-rank0", "--ckpt",
                                          str(folder / "ckpt.pt"), "--no-broadcast-buffers", "--port",
                                          str(launch.free_port())], timeout=300,
                                         env=launch.make_env(PYTHONPATH=launch.REPO))}
    with ThreadPoolExecutor(len(runs)) as pool:
        return dict(zip(runs, pool.map(lambda run: run(), runs.values()))), hidden


@pytest.mark.slow
def test_debug_tools_on_a_job_launched_by_mp_spawn_or_torchrun_with_dataloader_workers(launched, request):
    """tests/workers/spawn_train.py (mp.spawn, so no RANK in the ranks' environment; 2 DataLoader workers per rank;
    BatchNorm under DDP; check_replicas every 4 steps), three runs at once:
    - mp.spawn, rank 0 alone in a barrier: `stacks` from mp.spawn's parent finds both ranks, each labelled with its
      rank, and their workers; from a worker's pid, the same, the worker named as such, no "run this on every node";
      from `sleep`, one line; under a venv's python (not activated) with py-spy beside it, found; with py-spy hidden,
      one line that says how to get it and what faulthandler does instead. check_replicas at step 0, after a step:
      quiet, BatchNorm's statistics reported as what DDP overwrites (broadcast_buffers=True).
    - the same under torchrun: a worker's pid (RANK inherited) is a worker of its rank, both ranks found.
    - mp.spawn, a resume in which rank 0 alone loads the optimizer's state, broadcast_buffers=False: the error
      counts every difference, the optimizer's state listed before the parameters, then BatchNorm's statistics."""
    results, hidden = launched[request.node.name].result()
    out, found = results["mp.spawn"]
    assert found, f"mp.spawn: the job never hung as planned\n{out[-3000:]}"
    pids, stacks = found
    ranks = f"2 rank(s) of 2 on this machine (no RANK in their environment: ranks read from `rank` in demo_basic): " \
            f"rank 0 pid {pids['0']}, rank 1 pid {pids['1']}\n"
    for how in ("launcher", "worker", "beside"):
        assert ranks in stacks[how] and "every node" not in stacks[how], f"{how}: {stacks[how]}"
        assert re.search(r"demo_basic \(spawn_train.py:\d+\) in barrier", where(stacks[how], 0)), stacks[how]
        assert "demo_basic (spawn_train.py:" in where(stacks[how], 1), stacks[how]
    assert f"{pids['0.0']}, {pids['0.1']} of rank 0; " in stacks["launcher"] or \
        f"{pids['0.1']}, {pids['0.0']} of rank 0; " in stacks["launcher"], stacks["launcher"]
    assert stacks["worker"].startswith(f"pid {pids['1.0']} is a DataLoader worker of the rank with pid {pids['1']}, "
                                       "not a rank"), stacks["worker"]
    sleep = stacks["sleep"]
    assert re.fullmatch(r"error: pid \d+ \(sleep\) is not a training process\. [^\n]*\n", sleep), sleep
    assert stacks["hidden"].startswith(f"error: py-spy not found (not on PATH, nor beside {hidden}). Install it "
                                       "with pip install py-spy. Without it, ") and stacks["hidden"].count("\n") == 1, \
        stacks["hidden"]
    assert "kill -USR1 PID" in stacks["hidden"] and "PYTHONFAULTHANDLER=1" in stacks["hidden"], stacks["hidden"]
    for rank in (0, 1):  # check_replicas after a step of a correct DDP + BatchNorm job: no error
        assert f"rank {rank} replicas identical on 2 ranks: " in out and "2 buffer(s) differ by design, since DDP " \
            "(broadcast_buffers=True) overwrites them with rank 0's as its next forward starts" in out, out[-3000:]

    out, found = results["torchrun"]
    assert found, f"torchrun: the job never hung as planned\n{out[-3000:]}"
    pids, stacks = found
    assert stacks["worker"].startswith(f"pid {pids['0.1']} is a DataLoader worker of the rank with pid {pids['0']}, "
                                       "not a rank"), stacks["worker"]
    assert f"\n2 rank(s) of 2 on this machine: rank 0 pid {pids['0']}, rank 1 pid {pids['1']}\n" in stacks["worker"]
    assert re.search(r"demo_basic \(spawn_train.py:\d+\) in barrier", where(stacks["worker"], 0)), stacks["worker"]

    res = results["resume"]
    assert not res.timed_out and res.returncode != 0, res.output[-3000:]
    lines = res.output[res.output.find("ReplicasDiffer: "):].splitlines()
    assert lines[0] == "ReplicasDiffer: replicas differ in 14 places (optimizer state 6, parameters 6, buffers 2), " \
        "the optimizer's state and settings first, as they make the parameters drift a step later", res.output[-3000:]
    assert all(ln.startswith("  optimizer state[module.") for ln in lines[1:4]), lines
    assert lines[4] == "  ... 3 more optimizer state (the exception's .differences lists all)", lines
    assert lines[5].startswith("  module.net1.weight (float32, (10, 10)) on rank(s) [1] differs"), lines
    assert lines[9].startswith("  module.bn.running_mean (float32, (10,)) on rank(s) [1] differs"), lines
    assert "DDP with broadcast_buffers=False (or forward_sync_buffers=False) does not copy them" in lines[11], lines
