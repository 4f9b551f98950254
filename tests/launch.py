"""The one helper every distributed test uses: run a script under torchrun with N CPU ranks.

torchrun (``python -m torch.distributed.run``) starts each worker in a new session, so killing the
agent's process group would orphan the workers. On timeout we therefore collect the whole process tree
first, send the agent SIGTERM (it forwards the signal to its workers), and SIGKILL whatever is left.
A hang fails the test in ``timeout`` seconds instead of stalling CI.
"""

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Result:
    returncode: int
    output: str  # stdout and stderr together, in order
    timed_out: bool

    def ok_line(self):
        """The rank-0 line that starts with OK, or None."""
        return next((ln for ln in self.output.splitlines() if ln.startswith("OK")), None)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_env(**extra):
    env = dict(os.environ)
    env.update(
        GLOO_SOCKET_IFNAME="lo",  # loopback only: no route needed, nothing leaves the machine
        HF_HUB_OFFLINE="1",  # nothing may be downloaded in tests
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",  # 2-3 ranks on 2 cores: one thread each avoids oversubscription
        PYTHONUNBUFFERED="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",  # restarts re-rendezvous cleanly (pytorch#135712)
    )
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _children():
    """Map pid -> list of child pids, read from /proc. Key ("session", sid) lists a session's processes."""
    tree = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid, sid = (int(x) for x in f.read().rsplit(")", 1)[1].split()[1:4:2])
        except (OSError, IndexError, ValueError):
            continue
        tree.setdefault(ppid, []).append(int(d))
        tree.setdefault(("session", sid), []).append(int(d))
    return tree


def descendants(pid):
    tree, out, todo = _children(), [], [pid]
    while todo:
        for c in tree.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_tree(proc):
    """SIGTERM the agent (it forwards to workers), then SIGKILL every process that is left."""
    pids = descendants(proc.pid)
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=5)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    # and every process of its session (run() starts one): a child whose parent died first has no parent here
    for pid in [proc.pid] + pids + descendants(proc.pid) + _children().get(("session", proc.pid), []):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def run(cmd, timeout, env=None, cwd=REPO):
    """Run ``cmd`` in its own session; on timeout kill the whole tree and return timed_out=True."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env or make_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        return Result(proc.returncode, out, False)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out = proc.stdout.read() if proc.stdout else ""
        return Result(proc.returncode if proc.returncode is not None else -9, out, True)


def torchrun_cmd(script, nproc, args=(), torchrun_args=()):
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes=1", f"--nproc_per_node={nproc}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        *torchrun_args, str(REPO / script), *map(str, args),
    ]


def with_device(args, device):
    """Tests check CPU properties (gloo, bit-identical runs) unless they ask for CUDA: name the device always,
    so that the suite means the same on a machine with GPUs."""
    return [*map(str, args)] + (["--device", device] if device else [])


HEAVY = {  # what a script's ranks import besides torch, so that a forked launch imports it once for all ranks
    "05_manual_ddp_gpt2.py": ("transformers",), "07_zero.py": ("transformers",),
    "08_fsdp.py": ("transformers", "torch.distributed.checkpoint.state_dict", "torch.distributed.fsdp"),
    "06_torch_ddp_resnet.py": ("torchvision",), "ddp_step.py": ("transformers",), "overlap.py": ("transformers",),
    "costmodel.py": ("transformers",), "compile_worker.py": ("transformers",), "resnet_worker.py": ("torchvision",),
    "fsdp_worker.py": ("torch.distributed.checkpoint.state_dict", "torch.distributed.fsdp")}


def torchrun(script, nproc, args=(), timeout=180, torchrun_args=(), device="cpu", fork=True, **env):
    """Launch ``script`` under torchrun with ``nproc`` ranks (CPU, gloo by default). Never hangs past ``timeout``.
    On the CPU, with no torchrun flags, the ranks are forked by torchrun's own agent from one process that
    imported torch (and HEAVY's modules) once: on 2 cores a launch's imports cost more than most tests' work. The
    GPU tier, tests that pass torchrun flags and fork=False run the torchrun command itself."""
    if fork and device in ("cpu", None) and not torchrun_args:
        preload = ("torch", *HEAVY.get(Path(script).name, ()))
        return torchrun_forked(script, {nproc: args}, preload=preload, timeout=timeout, device=device, **env)[nproc]
    t0 = time.time()
    res = run(torchrun_cmd(script, nproc, with_device(args, device), torchrun_args), timeout, env=make_env(**env))
    res.output += f"\n[launch] {script} x{nproc} took {time.time() - t0:.1f}s\n"
    return res


def kill_a_worker_after(script, text, args, timeout, nproc=2):
    """``script`` under torchrun (``nproc`` ranks, one restart allowed). Once a line holds ``text``, one worker
    is SIGKILLed from outside, as a machine fault would do it; torchrun then stops the others and starts them all
    again. Returns the Result and the pid killed (None if ``text`` never came)."""
    import threading
    cmd = torchrun_cmd(script, nproc, with_device(args, "cpu"), ["--max-restarts=1"])
    proc = subprocess.Popen(cmd, cwd=REPO, env=make_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    timer = threading.Timer(timeout, kill_tree, [proc])  # a hang ends the test, not the suite
    timer.start()
    output, killed = [], None
    for line in proc.stdout:
        output.append(line)
        if killed is None and text in line:
            for pid in descendants(proc.pid):
                with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read()
                    if Path(script).name.encode() in argv and b"torch.distributed.run" not in argv:
                        killed = pid  # a worker, not the agent
            if killed is not None:
                os.kill(killed, signal.SIGKILL)
                output.append(f"[test] SIGKILL to worker {killed}\n")
    proc.wait()
    timer.cancel()
    return Result(proc.returncode, "".join(output), not timer.is_alive() and proc.returncode == -9), killed


def ranks(script, nproc, args=(), timeout=120, device="cpu", cwds=None, **env):
    """Start ``nproc`` plain processes with the environment torchrun gives its workers, but no agent.

    Under torchrun a dead worker makes the agent stop the others, so what survivors print is a race; here
    nobody stops them, and what they do is the script's own doing. Returns one Result per rank. Output goes
    to files, not pipes, so that no rank blocks on a full pipe while we wait for another. ``cwds``: a working
    directory per rank (relative paths then differ per rank, like nodes without a shared filesystem).
    """
    import tempfile
    port, procs = free_port(), []
    for r in range(nproc):
        log = tempfile.TemporaryFile(mode="w+")
        env_r = make_env(RANK=r, LOCAL_RANK=r, WORLD_SIZE=nproc, LOCAL_WORLD_SIZE=nproc, MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=port, **env)
        cmd = [sys.executable, str(REPO / script), *with_device(args, device)]
        procs.append((subprocess.Popen(cmd, cwd=cwds[r] if cwds else REPO, env=env_r, stdout=log,
                                       stderr=subprocess.STDOUT, text=True, start_new_session=True), log))
    deadline, results = time.time() + timeout, []
    for proc, log in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.time()))
            timed_out = False
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            timed_out = True
        log.seek(0)
        results.append(Result(proc.returncode, log.read(), timed_out))
        log.close()
    return results


def python(script, args=(), timeout=120, device="cpu", **env):
    """Run ``script`` as one plain process (no torchrun)."""
    return run([sys.executable, str(REPO / script), *with_device(args, device)], timeout, env=make_env(**env))


def forked_cases(runs, folder, timeout=300):
    """Run tests/workers/usage_worker.py on ``runs`` ((script, argv, as, env) each, see its docstring): one import,
    a forked child per case. Returns [[exit code, output]] in the order of ``runs``."""
    import json
    cases, result = Path(folder) / "cases.json", Path(folder) / "result.json"
    cases.write_text(json.dumps([(script, [*map(str, argv)], how, env) for script, argv, how, env in runs]))
    res = run([sys.executable, "tests/workers/usage_worker.py", str(cases), str(result)], timeout)
    assert not res.timed_out and res.returncode == 0, res.output
    return json.loads(result.read_text())


@contextlib.contextmanager
def ahead(request, jobs, workers=2):
    """For a module-scoped fixture: start now, `workers` at a time and in the order given (the longest first), the
    jobs of this module whose tests the session will run; yields {test name: Future}, and waits for them all at the
    end. ``jobs``: {a test's name as pytest names it, parameters included: a function that launches what it checks}.
    A launch that mostly waits (a hang, engines starting, one process on one of the 2 cores) then runs while others
    work, each test still asserting on its own launch's result."""
    from concurrent.futures import ThreadPoolExecutor
    pool = ThreadPoolExecutor(workers)
    try:
        yield {name: pool.submit(job) for name, job in jobs.items() if name in chosen(request)}
    finally:
        pool.shutdown(cancel_futures=True)  # an interrupted session waits only for the launches already running


def chosen(request):
    """The names of the tests of this module that the session will run (parameters included)."""
    return {item.name for item in request.session.items if item.module is request.module}


FORKED = """
import importlib, json, os, runpy, socket, sys
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def rank(script, argv):  # a worker: the script as `python script argv` runs it, in a process forked from here
    sys.argv, sys.path[0] = [script, *argv], os.path.dirname(script)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    except Exception:  # as Python ends a script: the traceback through sys.excepthook (c10d's: "[rank1]: ..."), 1
        sys.excepthook(*sys.exc_info())
        raise SystemExit(1) from None


preload, script, jobs = sys.argv[1:]
for name in filter(None, preload.split(",")):
    importlib.import_module(name)
for n, argv in json.loads(jobs):
    print(f"[forked] {n} ranks", flush=True)
    pid = os.fork()  # each job from this process as it is now (imported, nothing else run), one after the other
    if pid == 0:
        code = 1
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            elastic_launch(LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=str(port),
                                        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{port}", max_restarts=0,
                                        monitor_interval=0.1, start_method="fork"), rank)(script, argv)
            code = 0
        except Exception as e:  # the agent's ChildFailedError: which rank failed, and how, as torchrun says it
            print(e, flush=True)
        finally:
            sys.stdout.flush()
            os._exit(code)
    print(f"[forked] {n} ranks exit {os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}", flush=True)
os._exit(0)  # not a second of tearing down what was imported
"""


def torchrun_forked(script, jobs, preload=("torch",), timeout=180, device="cpu", **env):
    """``script`` under torchrun's own agent (torch.distributed's elastic_launch: torchrun's rendezvous and its
    workers' environment), one job after the other, ``jobs`` {nproc: args}, every rank forked from one process that
    imported ``preload`` once: for workers whose ranks would spend most of their time importing (torch 2 s a rank,
    transformers and lightning 8 s). Returns {nproc: Result}; never hangs past ``timeout`` in all."""
    import json
    t0 = time.time()
    cmd = [sys.executable, "-c", FORKED, ",".join(preload), str(REPO / script),
           json.dumps([(n, with_device(args, device)) for n, args in jobs.items()])]
    res = run(cmd, timeout, env=make_env(**env))
    took = f"\n[launch] {script} x{'/'.join(map(str, jobs))} (forked) took {time.time() - t0:.1f}s\n"
    results = {}
    for n in jobs:
        job = re.search(rf"^\[forked\] {n} ranks\n(.*?)^\[forked\] {n} ranks exit (-?\d+)$", res.output, re.S | re.M)
        results[n] = Result(int(job.group(2)), job.group(1) + took, res.timed_out) if job else \
            Result(res.returncode or -1, res.output + took, res.timed_out)  # it never ended: all that was said
    return results
