"""The ranks behind a notebook: N processes, each one rank of one torch.distributed group.

The first cell of every notebook here runs

    import ranks
    rc = ranks.start(RANKS)

After that, a `%%px` cell runs on every rank, and a `%%px --targets 0` cell on rank 0 alone. Each
rank's output shows under the cell, tagged [stdout:r]. A rank is an ipyparallel engine, a real
process. It joins the group through the numbered scripts' own setup(), so it picks its device as
they do. In every rank, `load("05_manual_ddp_gpt2.py")` imports a numbered script. So a notebook
runs the scripts' code, never a copy. `ranks.show(file, name)` displays a piece of that code, as
rank 0 has loaded it.

A mistake costs one cell. A collective that cannot complete ends its cell after TIMEOUT_S seconds,
with one GroupError that says who waited where. That group cannot be used again, and every later
cell says so at once. `ranks.reset()` starts a fresh group of the same size. The kernel keeps its
variables, and `rc` talks to the new group. The ranks lose theirs. Stop interrupts the ranks. A rank
stuck inside a collective cannot be interrupted, and the cell then says to reset.
`ranks.check(name)` grades a "Your turn" cell on every rank, with the checks behind
exercises/check.py.

No rank outlives its notebook. This file starts each engine and ipyparallel's controller in a
process group of its own (see its end). A thread there watches the kernel that started them. Once
that kernel is gone, it kills the whole group within POLL_S seconds. The engines run without
ipyparallel's nanny, a process outside that group. The cluster's files live in a private profile
directory, removed with the ranks.
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
RESET = "Run ranks.reset() for a fresh group"  # the advice, which works as written (see Ranks)

_state = {}  # this kernel's cluster: cluster, client, pids, profile, args of start(), broken, busy


class GroupError(RuntimeError):
    """The ranks' group is stuck or broken. The message says what happened and what to do."""

    def _render_traceback_(self):  # IPython shows this instead of a traceback
        return [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {self}"]


class CheckFailed(AssertionError):
    """The reader's "Your turn" code is wrong. The message says what, where, and the usual cause."""

    _render_traceback_ = GroupError._render_traceback_


class Ranks:
    """What `rc` holds: rc[:] is every rank, rc[0] is rank 0 (ipyparallel's views of the engines).

    It is one object for the kernel's whole life. A reset gives it the new group's client. So a cell
    that uses `rc` works after `ranks.reset()`, and after `rc = ranks.reset()` too."""

    def __getitem__(self, key):
        return _client()[key]

    def __getattr__(self, name):  # the rest of ipyparallel's Client: rc.ids, rc.wait(), ...
        if name.startswith("_"):  # IPython looks for _repr_html_ and such: not the client's
            raise AttributeError(name)
        return getattr(_client(), name)

    def __repr__(self):
        if _state.get("cluster") is None:
            return "<no ranks: run ranks.start(n)>"
        return f"<{_state['args'][0]} ranks: rc[:] is every rank, rc[0] is rank 0>"


rc = Ranks()  # what start() and reset() return


def _client():
    if _state.get("cluster") is None:
        raise GroupError("there are no ranks. Run the first cell (ranks.start).")
    return _state["client"]


def start(n, timeout_s=TIMEOUT_S, device="auto"):
    """Stop this kernel's ranks, if any. Start `n` new ones in one group, and return `rc`.
    `device` is "auto" (the scripts' rule), "cpu" or "cuda", as the scripts' --device."""
    import ipyparallel as ipp
    from IPython import get_ipython
    from traitlets.config import Config

    stop()
    profile = tempfile.mkdtemp(prefix="ranks-profile-")  # private: removed with the ranks
    watched = [sys.executable, str(Path(__file__).resolve()), str(os.getpid()), profile]  # the end
    config = Config()
    # The controller's heartbeat notices a rank whose process ended (a crash, NCCL's watchdog)
    # within 5 s, not ipyparallel's default 30. Its nanny would tell at once, but it is off.
    config.LocalControllerLauncher.controller_cmd = [
        *watched, "ipyparallel.controller", "--HeartMonitor.period=1000",
        "--HeartMonitor.max_heartmonitor_misses=5"]
    config.LocalEngineLauncher.engine_cmd = [*watched, "ipyparallel.engine",
                                             "--IPEngine.enable_nanny=False"]
    # log_level 40: errors only. No shutdown at exit: stop() kills, faster than asking.
    cluster = ipp.Cluster(n=n, config=config, log_level=40, profile_dir=profile, cluster_file="",
                          shutdown_atexit=False)
    _state.update(cluster=cluster, profile=profile, args=(n, timeout_s, device), broken=None,
                  busy=None, pids=[])
    if not _state.get("atexit"):  # a kernel that shuts down kills its ranks on its way out
        _state["atexit"] = atexit.register(stop)
    try:
        _start(cluster, n, timeout_s, device)
    except BaseException:
        stop()  # half-started: nothing stays behind
        raise
    finally:
        _take_over_px(get_ipython())  # %%px refuses in words while there are no ranks
    print(f"{n} ranks joined one group. %%px cells run on all of them, %%px --targets 0 on rank 0.")
    return rc


def _start(cluster, n, timeout_s, device):
    cluster.start_cluster_sync()
    client = _state["client"] = cluster.connect_client_sync()
    client.wait_for_engines(n, timeout=120, interactive=False)
    client.activate()  # the %%px magics address these engines
    with socket.socket() as s:  # a free port for the group's rendezvous (rank 0 listens on it)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Each engine becomes rank r of n, with the environment torchrun would give it. They join all at
    # once, since init_process_group returns only when every rank has called it.
    joins = [client[r].apply_async(_join, r, n, port, timeout_s, device) for r in range(n)]
    said = [j.get(timeout=timeout_s + 60) for j in joins]
    _state["pids"] = [pid for _, pid in said]
    print(said[0][0])


def reset():
    """Stop the ranks and start as many afresh, in a new group. Return `rc`, which talks to it now.
    The kernel keeps its variables. The ranks lose theirs: run again the cells that define them."""
    if "args" not in _state:
        raise GroupError("there are no ranks to reset. Run the first cell (ranks.start).")
    return start(*_state["args"])


def stop():
    """Stop this kernel's ranks at once. (They would also end by themselves with the kernel.)"""
    cluster, _state["cluster"] = _state.get("cluster"), None
    if cluster is None:
        return
    if _state.get("client") is not None:
        _state.pop("client").close()
    engines = [e for s in (cluster.engines or {}).values() for e in s.launchers.values()]
    for launcher in [cluster.controller, *engines]:
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
    """Import a numbered script by its file name, afresh, so it reads this rank's environment."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import lessons
    return lessons.load(filename, fresh=True)


# --- showing the scripts' code: rank 0's loaded module, not a copy ---
class Source:
    """A piece of a script, shown as a python block. (In markdown, which GitHub highlights.)"""

    def __init__(self, pieces):
        self.pieces = pieces  # (file, qualified name, first line, source)

    def _repr_markdown_(self):
        return "\n\n".join(f"`{file}`, `{name}` (line {line}):\n```python\n{code.rstrip()}\n```"
                           for file, name, line, code in self.pieces)

    def __repr__(self):
        return "\n\n".join(f"# {file}, {name} (line {line})\n{code.rstrip()}"
                           for file, name, line, code in self.pieces)


def show(filename, *names):
    """Display the source of `names` ("tree_broadcast", "DDPCore._launch") from the numbered script
    `filename`, as rank 0 has loaded it. So it is the code the cells run."""
    _ready()
    return Source(_client()[0].apply_sync(_sources, filename, names))


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
    """Route %%px and %px through _px, which turns a stuck or broken group into one GroupError."""
    if shell is None or "ParallelMagics" not in shell.magics_manager.registry:
        return  # no IPython, or the client never came up: no %%px to take over
    magics = shell.magics_manager.registry["ParallelMagics"]
    # No progress bar. In a headless run, every redraw would stay in the saved cell as a line.
    magics.progress_after_seconds = -1
    # The ranks' outputs come in rank order once the cell is done. A rank's error is then shown
    # once, by the cell's error, and not streamed above it too.
    magics.stream_output = False
    magics.signal_on_interrupt = None  # ipyparallel would signal through the nanny, which is off
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
        # Stop gives a KeyboardInterrupt, or an error it caused in ipyparallel's display.
        if isinstance(e, KeyboardInterrupt) or isinstance(e.__context__, KeyboardInterrupt):
            sent = magics.last_result if magics.last_result is not before else None
            raise _interrupted(sent) from None
        if not isinstance(e, Exception):
            raise
        targets = getattr(magics.last_result, "_targets", None)
        said = _explain(e, targets if isinstance(targets, list) else None)
        if said is None:
            raise
        raise GroupError(said) from None


def _ready():
    """Refuse at once when a rank is gone or stuck, rather than wait for one that never answers."""
    _client()
    gone = sorted(set(range(_state["args"][0])) - set(_state["client"].ids))
    if gone:
        raise GroupError(f"{_ranks(gone, 'is', 'are')} gone (the process ended), so this group "
                         f"cannot be used again. {RESET}.")
    busy = _state.get("busy")
    if busy is not None and not busy.done():
        stuck = [r for r, f in zip(busy._targets, busy._children) if not f.done()]
        raise GroupError(f"{_ranks(stuck, 'is', 'are')} still inside an interrupted cell, probably "
                         f"stuck in a collective. No other cell can run there. {RESET}.")
    if busy is not None:  # it ended after all (a collective's timeout): the group may have broken
        _state["busy"] = None
        try:
            busy.get()
        except Exception as e:
            _explain(e)
    if _state.get("broken"):  # gloo's pairs are out of step: a collective would fail, or wait
        raise GroupError(f"the group broke in an earlier cell ({_state['broken']}), so it cannot "
                         f"be used again. {RESET}, then run the cells this one needs.")


def _interrupted(result, grace_s=1):
    """Stop was pressed: interrupt the ranks still in the cell. One in a collective won't stop."""
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
        return GroupError(f"interrupted, but {_ranks(stuck)} did not stop. A rank inside a "
                          f"collective cannot be interrupted, and no other cell can run there. "
                          f"{RESET}.")
    result.display_outputs()  # what the ranks printed before they stopped
    return GroupError(f"interrupted {_ranks(running)}. If a rank left a collective that others "
                      f"were in, the group is out of step. {RESET} if the next cell hangs or "
                      "fails.")


DIST_ERRORS = ("DistBackendError", "DistNetworkError", "DistStoreError", "DistError")


def _explain(error, targets=None):
    """The GroupError message for a failed cell, or None if no collective broke."""
    from ipyparallel import error as ipp_error

    error = getattr(error, "original_error", error)  # AlreadyDisplayedError wraps the ranks' errors
    if isinstance(error, ipp_error.CompositeError):
        failed = [(e[3].get("engine_id"), e[0], e[1], e[2]) for e in error.elist]
    elif isinstance(error, ipp_error.RemoteError):
        failed = [(error.engine_info.get("engine_id"), error.ename, error.evalue, error.traceback)]
    else:
        return None
    for k, (_, ename, evalue, tb) in enumerate(failed):  # a dead rank's id is in the words
        died = re.match(r"Engine (\d+) died", str(evalue or "")) if ename == "EngineError" else None
        if died:
            failed[k] = (int(died.group(1)), ename, evalue, tb)
    broke = [(r, "died" if ename == "EngineError" else _collective(tb), evalue)
             for r, ename, evalue, tb in failed
             if ename == "EngineError" or _is_dist(ename, evalue, tb)]
    if not broke:
        return None
    n = _state["args"][0]
    what = [f"rank {r}'s process died" if op == "died" else
            f"rank {r} {'timed out' if 'imed out' in ev or 'timeout' in ev else 'failed'} in {op}"
            for r, op, ev in broke]
    ran = range(n) if targets is None else targets  # %%px --targets 0: the others never saw it
    others = [r for r in ran if r not in {b[0] for b in broke}]
    other_failed = [f for f in failed if f[0] in others]
    if other_failed:
        what += [f"{_failures(other_failed)}, so never joined it"]
    elif others:
        what += [f"{_ranks(others)} finished the cell without joining it"]
    if len(ran) < n:
        left_out = sorted(set(range(n)) - set(ran))
        what += [f"{_ranks(left_out, 'was', 'were')} not in the cell's --targets"]
    _state["broken"] = _listed(what)
    return f"{_listed(what)}. This group cannot be used again. {RESET} of {n} ranks."


def _is_dist(ename, evalue, tb):
    words = ("Timed out", "timed out", "Connection closed by peer", "pair closure",
             "Connection reset", "NCCL", "Watchdog caught collective operation timeout")
    said = ename == "RuntimeError" and any(w in str(evalue) for w in words)
    return ename in DIST_ERRORS or said


def _collective(tb):
    """The torch.distributed function a rank failed in, from its traceback: 'dist.all_reduce'."""
    calls = re.findall(r"distributed_c10d\.py:\d+,? in (\w+)"
                       r"|distributed_c10d\.py\", line \d+, in (\w+)", _plain(tb))
    names = [a or b for a, b in calls if not (a or b).startswith("_") and (a or b) != "wrapper"]
    if names:
        return f"dist.{names[0]}"
    if re.search(r"(send|recv) operation", _plain(tb)):
        return "a send/recv's wait()"
    return "a collective"


def _failures(failed):
    return _listed([f"rank {r} failed ({ename}: {_first_line(evalue)})"
                    for r, ename, evalue, _ in failed])


def _first_line(text):
    lines = _plain(str(text or "")).strip().splitlines()
    line = re.sub(r"^\[[^\]]*\] ", "", lines[0]) if lines else ""  # drop gloo's "[/path/x.cc:78] "
    return line if len(line) <= 120 else line[:117].rsplit(" ", 1)[0] + " ..."


def _plain(text):
    return re.sub(r"\x1b\[[0-9;]*m", "", text or "")


def _ranks(ranks, *verb):
    """'rank 1' or 'ranks 0, 1'; with verb=('is', 'are'), followed by the verb that agrees."""
    ranks = sorted(ranks)
    said = ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
    return f"{said} {verb[len(ranks) > 1]}" if verb else said


def _listed(items):
    """'a', 'a and b', 'a, b, and c'."""
    if len(items) < 3:
        return " and ".join(items)
    return ", ".join(items[:-1]) + ", and " + items[-1]


# --- "Your turn": the reader's code, graded on every rank by exercises/grading.py ---
CHECKS = {  # exercise: the name the reader's cell defines, and where the script's own version is
    "ring_all_reduce": ("ring_all_reduce", "03_all_reduce.py", ["ring_all_reduce"]),
    "ddp_naive": ("average_gradients", "05_manual_ddp_gpt2.py", ["average_gradients"]),
    "zero1": ("ZeroDDP", "07_zero.py", ["ZeroDDP._all_reduce", "ZeroDDP.step"]),
}


def check(name):
    """Grade the reader's `name`, defined by a %%px cell, on every rank, as exercises/check.py does.
    Print what passed, or raise CheckFailed saying what is wrong."""
    _ready()
    defined, script, shown = CHECKS[name]
    result = _client()[:].apply_async(_grade, name, defined, _state["args"][1])
    try:
        verdicts = result.get()
    except KeyboardInterrupt:
        raise _interrupted(result) from None
    except Exception as e:
        said = _explain(e)
        if said is None:
            raise
        raise GroupError(said) from None
    call = f"ranks.show({script!r}, {', '.join(map(repr, shown))})".replace("'", '"')
    see = f"To see {script[:2]}'s own version, run {call} in a new cell."
    kinds = {v[0] for v in verdicts}
    if "broken" in kinds:  # a rank waited in a message or collective that others never joined
        stuck = [r for r, v in enumerate(verdicts) if v[0] == "broken"]
        what = "; ".join(f"rank {r} {verdicts[r][1]}" for r in stuck)
        # check.py's analysis of a hang: who waits for whom, do the pairs match, the usual cause.
        hangs = [v[2] if v[0] == "broken" else None for v in verdicts]
        said, hint = _checker().diagnosis(hangs, name)
        _state["broken"] = f"the check of your {defined}, where {_ranks(stuck)} got stuck"
        said = f" {said}." if said else ""
        raise GroupError(f"your {defined} left the ranks out of step: {what}.{said}\n"
                         f"  hint: {hint}.\nThis group cannot be used again. {RESET}, then run the "
                         f"cell that defines {defined}, then this one.")
    if kinds == {"pass"}:
        print(f"passed on {len(verdicts)} ranks: " + "\n".join(verdicts[0][1])
              + f"\nTo compare with {script[:2]}'s own version, run {call} in a new cell.")
    elif kinds == {"not written"}:
        print(f"{defined}: not written yet. Fill in the cell above and run it, keeping its name. "
              f"Then run this cell again. {see}")
    else:
        r, (kind, said) = next((r, v) for r, v in enumerate(verdicts) if v[0] != "pass")
        who = ": " if kind == "fail" else f" (rank {r}) "
        raise CheckFailed(f"your {defined}{who}{said}\n{see}")


def _grade(name, defined, timeout_s):  # runs in every rank
    from datetime import timedelta

    import torch.distributed as dist

    import __main__

    sys.path.insert(0, str(REPO / "exercises"))
    import grading
    if dist.get_backend() != "gloo":
        return ("error", "cannot be checked on these ranks. The checks compare with the library "
                         "on the CPU, with gloo. Start the ranks with "
                         "ranks.start(RANKS, device='cpu').")
    obj = __main__.__dict__.get(defined)
    if obj is None:
        return ("error", f"is not defined on this rank. Run the %%px cell that defines {defined}.")
    grading.install_counters()  # counts the messages an answer sends, inside the checks' recordings
    # The verdicts travel in grading's own group. It gets this group's timeout, not gloo's default
    # 30 minutes, because a rank that fails in the reader's code leaves the others waiting there.
    if id(dist.group.WORLD) not in grading._books:
        grading._books[id(dist.group.WORLD)] = dist.new_group(backend="gloo",
                                                              timeout=timedelta(seconds=timeout_s))
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
        # Count lines as Jupyter's editor does. Its line 1 is the %%px line, which ranks never see.
        line = frames[-1].lineno + 1 if frames else None
        where = f" (line {line} of your cell: `{frames[-1].line}`)" if frames else ""
        if _is_dist(type(e).__name__, str(e), ""):
            # Timed out, or lost its peer (which timed out first and closed the connection).
            stuck = any(w in str(e) for w in ("imed out", "Connection closed", "Connection reset"))
            said = "got stuck" if stuck else f"failed ({_first_line(e)})"
            if frames:  # where it waited, as check.py's watchdog records it
                where_ = {"file": "your cell", "line": line, "function": frames[-1].name,
                          "code": frames[-1].line}
                hang = grading.hang_record(where_, None)
            else:
                hang = grading.hang_record(None, grading._checker_frame(tb))
            call = f", {hang['call']['text']}" if hang["call"] else ""
            said += where + call or " in the check, waiting for the other ranks' verdict"
            return ("broken", said, hang)
        return ("error", f"raised {type(e).__name__}: {e}{where}")


def _checker():
    """exercises/check.py, imported in the kernel (it needs no torch there)."""
    if str(REPO / "exercises") not in sys.path:
        sys.path.insert(0, str(REPO / "exercises"))
    import check
    return check


def _in_cell(filename):
    """Code from a notebook cell (named after a temporary file), not from a script or a library."""
    return not filename.startswith((str(REPO), sys.prefix, sys.base_prefix))


def _raised_by_reader(e):  # the stub's own `raise NotImplementedError`
    return _in_cell(traceback.extract_tb(e.__traceback__)[-1].filename)


# --- inside each engine ---
def _join(rank, world, port, timeout_s, device):
    """Runs in engine `rank`. It becomes that rank of the group, and gives the cells their names."""
    import argparse

    import __main__  # the engine's interactive namespace, where %%px cells run

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    sys.path.insert(0, str(REPO / "notebooks"))
    import warnings

    import torch
    # tqdm (which transformers imports) takes an engine for a notebook and asks for widgets.
    warnings.filterwarnings("ignore", message="IProgress not found")
    torch.set_num_threads(1)  # N ranks on a laptop's cores: one thread each, as torchrun sets it
    block = load("01_send_recv.py")  # every script has the same setup block and device rule
    device = block.setup(argparse.Namespace(device=device, backend=None, timeout_s=timeout_s))
    __main__.__dict__.update(RANK=rank, WORLD=world, device=device, load=load)
    backend = torch.distributed.get_backend()
    said = f"rank 0 of {world}: device {device}, backend {backend}, timeout {timeout_s:g} s"
    return said, os.getpid()


if __name__ == "__main__":
    # python ranks.py KERNEL_PID PROFILE MODULE [ARGS...] runs ipyparallel's MODULE (an engine or
    # the controller) as `python -m MODULE ARGS` would. It ends once its kernel is gone.
    # ipyparallel starts each in a session of its own. So its process group holds it and whatever it
    # forks (the controller's schedulers), and they all go together. The controller also removes the
    # private profile.
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
