"""The ranks behind a notebook: N ipyparallel engines, each one process of one torch.distributed group.

The first cell of every notebook here runs

    import ranks
    rc = ranks.start(RANKS)

and from then on a `%%px` cell runs on every rank (its output shown under the cell, tagged [stdout:r] by rank),
`%%px --targets 0` on rank 0 alone. Each engine is a real process, started by ipyparallel, that joins the group
through the numbered scripts' own setup() (the same block in every script: CUDA and NCCL with a GPU per rank,
otherwise the CPU and gloo), with a timeout: a collective that cannot complete ends as an error in its cell after
TIMEOUT_S seconds instead of freezing the notebook. In every rank, `load("05_manual_ddp_gpt2.py")` imports a
numbered script, so a notebook runs the scripts' own code, never a copy; `ranks.show(file, name)` displays a piece
of it, taken from the module rank 0 has loaded.

A mistake costs one cell. When a `%%px` cell's collective times out, or a rank fails while the others wait for it,
the cell ends with one short error (GroupError) naming who waited where; the group cannot be used again (every later
cell says so at once), and `ranks.reset()` replaces it with a fresh one of the same size in a few seconds (the
kernel and its variables stay; the ranks' variables are lost). Stop (interrupt) interrupts the ranks; one stuck
inside a collective cannot be interrupted, and the cell then says to reset. `ranks.check(name)` grades the reader's
"Your turn" cell on every rank with exercises/grading.py, the checker behind exercises/check.py.

No rank outlives its notebook: each engine (and ipyparallel's controller) is started by this file (see its end)
in a process group of its own, and watches the kernel that started it: once that kernel is gone (shut down,
restarted or killed) the group is killed within 0.2 s. The engines run without ipyparallel's nanny (a process
outside that group), and the cluster's files live in a private profile directory, removed with the ranks.
"""

import atexit
import functools
import inspect
import os
import re
import runpy
import shutil
import signal
import socket
import sys
import tempfile
import textwrap
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 30  # how long a rank waits in a collective for the others before its cell fails
POLL_S = 0.2  # how often a rank looks whether its kernel is still there

_state = {}  # this kernel's cluster: cluster, client, pids, profile, args of start(), broken, busy


class GroupError(RuntimeError):
    """The ranks' group is stuck or broken; the message says what happened and what to do."""

    def _render_traceback_(self):  # IPython shows this instead of a traceback: the message is the whole story
        return [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {self}"]


class CheckFailed(AssertionError):
    """The reader's "Your turn" code is wrong; the message says what, where, and the usual cause."""

    _render_traceback_ = GroupError._render_traceback_


def start(n, timeout_s=TIMEOUT_S, device="auto"):
    """Stop the ranks this kernel started before, start `n` new ones, join them into one group. Returns the client.
    `device`: "auto" (the scripts' rule), "cpu" or "cuda", as the scripts' --device."""
    import ipyparallel as ipp
    from IPython import get_ipython
    from traitlets.config import Config

    stop()
    profile = tempfile.mkdtemp(prefix="ranks-profile-")  # private: removed with the ranks, whatever ends them
    watched = [sys.executable, str(Path(__file__).resolve()), str(os.getpid()), profile]  # see the end of the file
    config = Config()
    # A rank whose process ends (a crash, NCCL's watchdog) is noticed by the controller's heartbeat: within 5 s,
    # not ipyparallel's default 30 (its nanny, which would tell at once, is off: see the end of the file)
    config.LocalControllerLauncher.controller_cmd = [*watched, "ipyparallel.controller", "--HeartMonitor.period=1000",
                                                     "--HeartMonitor.max_heartmonitor_misses=5"]
    config.LocalEngineLauncher.engine_cmd = [*watched, "ipyparallel.engine", "--IPEngine.enable_nanny=False"]
    cluster = ipp.Cluster(n=n, config=config, log_level=40, profile_dir=profile, cluster_file="",
                          shutdown_atexit=False)  # 40: errors only; at exit stop() kills, faster than asking
    _state.update(cluster=cluster, profile=profile, args=(n, timeout_s, device), broken=None, busy=None, pids=[])
    if not _state.get("atexit"):  # a kernel shut down or restarted in order kills its ranks at once, on its way out
        _state["atexit"] = atexit.register(stop)
    try:
        rc = _start(cluster, n, timeout_s, device)
    except BaseException:
        stop()  # half-started: nothing stays behind
        raise
    finally:
        _take_over_px(get_ipython())  # %%px refuses in words while there are no ranks
    print(f"{n} ranks joined one group; %%px cells run on all of them, %%px --targets 0 on rank 0 alone")
    return rc


def _start(cluster, n, timeout_s, device):
    cluster.start_cluster_sync()
    rc = _state["client"] = cluster.connect_client_sync()
    rc.wait_for_engines(n, timeout=120, interactive=False)
    rc.activate()  # the %%px magics address these engines
    with socket.socket() as s:  # a free port for the group's rendezvous (rank 0 listens on it)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Each engine becomes rank r of n, with the environment torchrun would give it, then joins (all at once:
    # init_process_group returns only when every rank has called it).
    joins = [rc[r].apply_async(_join, r, n, port, timeout_s, device) for r in range(n)]
    said = [j.get(timeout=timeout_s + 60) for j in joins]
    _state["pids"] = [pid for _, pid in said]
    print(said[0][0])
    return rc


def reset():
    """A fresh group after a stuck or broken one: stop the ranks, start as many afresh, join them (a few seconds).
    The kernel's variables stay; the ranks' are gone, so run the cells that define what the next cell needs."""
    if "args" not in _state:
        raise GroupError("no ranks to reset: run the first cell (ranks.start)")
    return start(*_state["args"])


def stop():
    """Stop the ranks this kernel started, at once (they would also end by themselves with the kernel)."""
    cluster, _state["cluster"] = _state.get("cluster"), None
    if cluster is None:
        return
    if _state.get("client") is not None:
        _state.pop("client").close()
    launchers = [cluster.controller, *[e for s in (cluster.engines or {}).values() for e in s.launchers.values()]]
    for launcher in launchers:
        process = getattr(launcher, "process", None)
        if process is not None:  # each leads a process group of its own (the end of this file)
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
    cluster.controller, cluster.engines = None, {}
    shutil.rmtree(_state.pop("profile"), ignore_errors=True)


def load(filename):
    """Import a numbered script by its file name, afresh, so it reads this rank's environment (lessons.load)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import lessons
    return lessons.load(filename, fresh=True)


# --- showing the scripts' code: rank 0's loaded module, not a copy ---
class Source:
    """A piece of a script, shown as a python block (markdown: GitHub renders it highlighted)."""

    def __init__(self, pieces):
        self.pieces = pieces  # (file, qualified name, first line, source)

    def _repr_markdown_(self):
        return "\n\n".join(f"`{file}`, `{name}` (line {line}):\n```python\n{code.rstrip()}\n```"
                           for file, name, line, code in self.pieces)

    def __repr__(self):
        return "\n\n".join(f"# {file}, {name} (line {line})\n{code.rstrip()}" for file, name, line, code in self.pieces)


def show(filename, *names):
    """Display the source of `names` ("tree_broadcast", "DDPCore._launch") from the numbered script `filename`,
    as rank 0 has loaded it (what the cells run)."""
    _ready()
    return Source(_state["client"][0].apply_sync(_sources, filename, names))


def _sources(filename, names):  # runs in rank 0
    path = REPO / filename
    module = sys.modules.get(path.stem.lstrip("0123456789_"))
    if getattr(module, "__file__", None) != str(path):
        module = load(filename)
    pieces = []
    for name in names:
        obj = functools.reduce(getattr, name.split("."), module)
        lines, first = inspect.getsourcelines(inspect.unwrap(obj))
        pieces.append((filename, name, first, textwrap.dedent("".join(lines))))
    return pieces


# --- a mistake costs one cell ---
def _take_over_px(shell):
    """%%px and %px through _px: a stuck or broken group becomes one GroupError with what to do."""
    if shell is None or "ParallelMagics" not in shell.magics_manager.registry:
        return  # no IPython, or the client never came up: no %%px to take over
    magics = shell.magics_manager.registry["ParallelMagics"]
    # No progress bar: run headless (nbclient, nbconvert), every redraw of one stays in the saved cell as a line of
    # text; the cell's busy marker says as much.
    magics.progress_after_seconds = -1
    # Outputs in rank order once the cell is done, as run.py's: a rank's error is then shown once, by the cell's
    # error (its traceback, or one GroupError line), not streamed above it too.
    magics.stream_output = False
    magics.signal_on_interrupt = None  # ipyparallel would signal through the nanny, which these engines lack
    for kind in ("cell", "line"):
        px = shell.magics_manager.magics[kind]["px"]
        px = getattr(px, "ranks_original", px)
        wrapped = functools.partial(_px, px, magics)
        wrapped.ranks_original = px
        shell.magics_manager.magics[kind]["px"] = wrapped


def _px(px, magics, line="", cell=None):
    _ready()
    before = magics.last_result
    try:
        return px(line, cell) if cell is not None else px(line)
    except BaseException as e:
        # Stop: a KeyboardInterrupt, or an error of ipyparallel's display of the unfinished result that it caused
        if isinstance(e, KeyboardInterrupt) or isinstance(e.__context__, KeyboardInterrupt):
            sent = magics.last_result if magics.last_result is not before else None  # None: stopped before sending
            raise _interrupted(sent) from None
        if not isinstance(e, Exception):
            raise
        targets = getattr(magics.last_result, "_targets", None)
        said = _explain(e, targets if isinstance(targets, list) else None)
        if said is None:
            raise
        raise GroupError(said) from None


def _ready():
    """Refuse at once (instead of waiting for a rank that never comes back) when a rank is still stuck."""
    if _state.get("cluster") is None:
        raise GroupError("no ranks: run the first cell (ranks.start)")
    gone = sorted(set(range(_state["args"][0])) - set(_state["client"].ids))
    if gone:
        raise GroupError(f"{_ranks(gone)} gone (the process ended): the group cannot be used again. Run "
                         "ranks.reset() for a fresh group.")
    busy = _state.get("busy")
    if busy is not None and not busy.done():
        stuck = [r for r, f in zip(busy._targets, busy._children) if not f.done()]
        raise GroupError(f"{_ranks(stuck)} still inside an interrupted cell (stuck in a collective?): no other cell "
                         "can run there. Run ranks.reset() for a fresh group.")
    if busy is not None:  # it ended after all (a collective's timeout): the group may have broken there
        _state["busy"] = None
        try:
            busy.get()
        except Exception as e:
            _explain(e)
    if _state.get("broken"):  # gloo's pairs are out of step: a collective would fail, or wait the whole timeout
        raise GroupError(f"the group broke in an earlier cell ({_state['broken']}) and cannot be used again. Run "
                         "rc = ranks.reset() for a fresh group, then the cells this one needs.")


def _interrupted(result, grace_s=1):
    """Stop pressed: interrupt the ranks still running the cell; a rank stuck in a collective does not answer."""
    if result is None:
        return KeyboardInterrupt()
    running = [r for r, f in zip(result._targets, result._children) if not f.done()]
    for r in running:
        os.kill(_state["pids"][r], signal.SIGINT)
    deadline = time.time() + grace_s
    while not result.done() and time.time() < deadline:
        time.sleep(0.05)
    stuck = [r for r, f in zip(result._targets, result._children) if not f.done()]
    if stuck:
        _state["busy"] = result
        return GroupError(f"interrupted, but {_ranks(stuck)} did not stop (a rank inside a collective cannot be "
                          "interrupted): no other cell can run there. Run ranks.reset() for a fresh group.")
    result.display_outputs()  # what the ranks printed before they stopped
    return GroupError(f"interrupted {_ranks(running)}. If a rank left a collective the others were in, the group is "
                      "out of step: should the next cell hang or fail, run ranks.reset().")


DIST_ERRORS = ("DistBackendError", "DistNetworkError", "DistStoreError", "DistError")


def _explain(error, targets=None):
    """A GroupError's message for a failed cell, or None where the error speaks for itself (no collective broke)."""
    from ipyparallel import error as ipp_error

    error = getattr(error, "original_error", error)  # AlreadyDisplayedError: the ranks' errors, streamed already
    if isinstance(error, ipp_error.CompositeError):
        failed = [(e[3].get("engine_id"), e[0], e[1], e[2]) for e in error.elist]
    elif isinstance(error, ipp_error.RemoteError):
        failed = [(error.engine_info.get("engine_id"), error.ename, error.evalue, error.traceback)]
    else:
        return None
    for k, (_, ename, evalue, tb) in enumerate(failed):  # EngineError: the rank's process ended; its id is in words
        died = re.match(r"Engine (\d+) died", str(evalue or "")) if ename == "EngineError" else None
        if died:
            failed[k] = (int(died.group(1)), ename, evalue, tb)
    broke = [(r, "died" if ename == "EngineError" else _collective(tb), evalue) for r, ename, evalue, tb in failed
             if ename == "EngineError" or _is_dist(ename, evalue, tb)]
    if not broke:
        return None
    n = _state["args"][0]
    what = "; ".join(f"rank {r}'s process died" if op == "died" else
                     f"rank {r} {'timed out' if 'imed out' in ev or 'timeout' in ev else 'failed'} in {op}"
                     for r, op, ev in broke)
    ran = range(n) if targets is None else targets  # %%px --targets 0: the others never saw the cell
    others = [r for r in ran if r not in {b[0] for b in broke}]
    other_failed = [f for f in failed if f[0] in others]
    if other_failed:
        what += f"; {_failures(other_failed)}, so never joined it"
    elif others:
        what += f"; {_ranks(others)} finished the cell without joining it"
    if len(ran) < n:
        what += f"; {_ranks(sorted(set(range(n)) - set(ran)))} did not run the cell (not among its --targets)"
    _state["broken"] = what
    return f"{what}. The group cannot be used again: run ranks.reset() for a fresh group of {n} ranks."


def _is_dist(ename, evalue, tb):
    words = ("Timed out", "timed out", "Connection closed by peer", "pair closure", "Connection reset", "NCCL",
             "Watchdog caught collective operation timeout")
    return ename in DIST_ERRORS or (ename == "RuntimeError" and any(w in str(evalue) for w in words))


def _collective(tb):
    """The torch.distributed function a rank failed in, from its traceback: 'dist.all_reduce'."""
    calls = re.findall(r"distributed_c10d\.py:\d+,? in (\w+)|distributed_c10d\.py\", line \d+, in (\w+)", _plain(tb))
    names = [a or b for a, b in calls if not (a or b).startswith("_") and (a or b) != "wrapper"]
    if names:
        return f"dist.{names[0]}"
    return "a send/recv's wait()" if re.search(r"(send|recv) operation", _plain(tb)) else "a collective"


def _failures(failed):
    return "; ".join(f"rank {r} failed ({ename}: {_first_line(evalue)})" for r, ename, evalue, _ in failed)


def _first_line(text):
    lines = _plain(str(text or "")).strip().splitlines()
    line = re.sub(r"^\[[^\]]*\] ", "", lines[0]) if lines else ""  # gloo's "[/path/file.cc:78] " goes
    return line if len(line) <= 120 else line[:117].rsplit(" ", 1)[0] + " ..."


def _plain(text):
    return re.sub(r"\x1b\[[0-9;]*m", "", text or "")


def _ranks(ranks):
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


# --- "Your turn": the reader's code, graded on every rank by exercises/grading.py ---
CHECKS = {  # exercise: the name the reader's cell defines, and how to see a solution
    "ring_all_reduce": ("ring_all_reduce", "03_all_reduce.py's ring_all_reduce, shown in the next cell"),
    "ddp_naive": ("average_gradients", "05_manual_ddp_gpt2.py's average_gradients, shown in the next cell"),
    "zero1": ("ZeroDDP", "07_zero.py's ZeroDDP, whose step is shown in the next cell"),
}


def check(name):
    """Grade the reader's `name` (defined by a %%px cell on every rank) against the library, on every rank, as
    `python exercises/check.py NAME` does. Prints what passed; raises CheckFailed saying what is wrong."""
    _ready()
    defined, solution = CHECKS[name]
    rc = _state["client"]
    result = rc[:].apply_async(_grade, name, defined, _state["args"][1])
    try:
        verdicts = result.get()
    except KeyboardInterrupt:
        raise _interrupted(result) from None
    except Exception as e:
        said = _explain(e)
        if said is None:
            raise
        raise GroupError(said) from None
    see = (f"To see a solution: {solution}; or run `python exercises/check.py {name} --solution` in a terminal, "
           f"and read the file it grades.")
    kinds = {v[0] for v in verdicts}
    if "broken" in kinds:  # a rank failed or waited in a message or collective the others never joined
        stuck = [r for r, v in enumerate(verdicts) if v[0] == "broken"]
        what = "; ".join(f"rank {r} {verdicts[r][1]}" for r in stuck)
        # who waits for whom, whether the pairs match, the usual cause: check.py's own analysis of a hang
        said, hint = _checker().diagnosis([v[2] if v[0] == "broken" else None for v in verdicts], name)
        _state["broken"] = f"the check of your {defined}, where {_ranks(stuck)} got stuck"
        raise GroupError(f"your {defined} left the ranks out of step: {what}." + (f" {said}." if said else "")
                         + f"\n  hint: {hint}.\nThe group cannot be used again: run rc = ranks.reset(), then the "
                         f"cell that defines {defined}, then this one.")
    if kinds == {"pass"}:
        print(f"passed on {len(verdicts)} ranks: " + "\n".join(verdicts[0][1]))
    elif kinds == {"not written"}:
        print(f"{defined}: not written yet. Fill in the cell above (keep its name), run it, then run this cell "
              f"again. {see}")
    else:
        r, (kind, said) = next((r, v) for r, v in enumerate(verdicts) if v[0] != "pass")
        raise CheckFailed(f"your {defined}" + (": " if kind == "fail" else f" (rank {r}) ") + f"{said}\n{see}")


def _grade(name, defined, timeout_s):  # runs in every rank
    from datetime import timedelta

    import torch.distributed as dist

    import __main__

    sys.path.insert(0, str(REPO / "exercises"))
    import grading
    if dist.get_backend() != "gloo":
        return ("error", "cannot be checked here: the checks compare with the library on the CPU, with gloo. Start "
                         "the ranks with ranks.start(RANKS, device='cpu') to check your code.")
    obj = __main__.__dict__.get(defined)
    if obj is None:
        return ("error", f"is not defined on this rank: run the cell that defines {defined} (%%px, on every rank)")
    grading.install_counters()  # counts the messages a solution sends (only inside the checks' recordings)
    # The verdicts' own group (grading's), with the group's timeout, not gloo's default 30 minutes: a rank that fails
    # in the reader's code leaves the others waiting there for the verdict.
    if id(dist.group.WORLD) not in grading._books:
        grading._books[id(dist.group.WORLD)] = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    try:
        return ("pass", grading.EXERCISES[name].check(obj))
    except grading.Failed as e:
        return ("fail", str(e))
    except NotImplementedError as e:
        if _raised_by_reader(e):
            return ("not written", "")
        return ("error", f"raised NotImplementedError: {e}")
    except Exception as e:
        tb = traceback.extract_tb(e.__traceback__)
        frames = [f for f in tb if _in_cell(f.filename)]
        where = f" (line {frames[-1].lineno} of your cell: `{frames[-1].line}`)" if frames else ""
        if _is_dist(type(e).__name__, str(e), ""):
            # timed out, or lost its peer (who timed out first and closed the connection): the same hang
            stuck = any(w in str(e) for w in ("imed out", "Connection closed", "Connection reset"))
            said = "got stuck" if stuck else f"failed ({_first_line(e)})"
            if frames:  # where it waited, as check.py's watchdog records it
                hang = grading.hang_record({"file": "your cell", "line": frames[-1].lineno, "function":
                                            frames[-1].name, "code": frames[-1].line}, None)
            else:
                hang = grading.hang_record(None, grading._checker_frame(tb))
            call = f", {hang['call']['text']}" if hang["call"] else ""
            return ("broken", said + (where + call or " in the check, waiting for the other ranks' verdict"), hang)
        return ("error", f"raised {type(e).__name__}: {e}{where}")


def _checker():
    """exercises/check.py, imported in the kernel (it needs no torch there)."""
    if str(REPO / "exercises") not in sys.path:
        sys.path.insert(0, str(REPO / "exercises"))
    import check
    return check


def _in_cell(filename):
    """Code from a notebook cell (ipykernel names it after a temporary file), not from a script or a library."""
    return not filename.startswith((str(REPO), sys.prefix, sys.base_prefix))


def _raised_by_reader(e):
    return _in_cell(traceback.extract_tb(e.__traceback__)[-1].filename)  # the stub's own `raise NotImplementedError`


# --- inside each engine ---
def _join(rank, world, port, timeout_s, device):
    """Runs in engine `rank`: become that rank of the group, and give the notebook's cells their names."""
    import argparse

    import __main__  # the engine's interactive namespace, where %%px cells run

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    sys.path.insert(0, str(REPO / "notebooks"))
    import warnings

    import torch
    # tqdm (imported by transformers) takes an engine for a notebook and asks for widgets: its text bars are fine
    warnings.filterwarnings("ignore", message="IProgress not found")
    torch.set_num_threads(1)  # N ranks on a laptop's cores: one thread each, as torchrun sets it
    block = load("01_send_recv.py")  # the setup block, the same in every script: the device rule is the scripts'
    device = block.setup(argparse.Namespace(device=device, backend=None, timeout_s=timeout_s))
    __main__.__dict__.update(RANK=rank, WORLD=world, device=device, load=load)
    said = f"rank 0 of {world}: device {device}, backend {torch.distributed.get_backend()}, timeout {timeout_s:g} s"
    return said, os.getpid()


if __name__ == "__main__":
    # python ranks.py KERNEL_PID PROFILE MODULE [ARGS...]: run ipyparallel's MODULE (an engine or the controller) as
    # `python -m MODULE ARGS` would, and end this process once the kernel that started it is gone.
    # ipyparallel starts each in a session of its own, so its process group holds it and whatever it forks (the
    # controller's schedulers): all of them go together. The controller also removes the private profile.
    kernel, profile, module = int(sys.argv[1]), sys.argv[2], sys.argv[3]

    def watch():
        while os.getppid() == kernel:  # a dead parent's children are handed to another process
            time.sleep(POLL_S)
        if module == "ipyparallel.controller":
            shutil.rmtree(profile, ignore_errors=True)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()
    sys.argv = [module, *sys.argv[4:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
