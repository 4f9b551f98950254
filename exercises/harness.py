"""What every rung of exercises/grading.py runs inside: one rank of the checker.

It has four parts, in this order.
- Running one rank: join the group, import the participant's file, grade it, return a record.
- Agreement: every rank learns the first failure, so a failure never leaves the others waiting.
- The recorder: wrappers around torch.distributed count what a solution sends, and when.
- The watchdog: when a rank waits too long, it writes down where.
exercises/check.py starts the ranks and reads their records. notebooks/ranks.py runs the same checks
in a notebook's own ranks.
"""

import contextlib
import functools
import importlib.util
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKER_FILES = {os.path.join(HERE, "harness.py"), os.path.join(HERE, "grading.py")}


class Failed(AssertionError):
    """A check failed. The message says what and where, and after "hint:" the usual cause."""


def hinted(what: str, hint: str | None = None) -> str:
    """A failure's text: what is wrong, then the usual cause on a line of its own."""
    return what + (f"\n  hint: {hint}" if hint else "")


@dataclass
class Exercise:
    """One rung of the ladder, as check.py and the notebooks run it."""

    names: tuple[str, ...]  # what the file must define; the first one found is graded
    ranks: int  # how many processes the checker starts (1: no process group)
    check: Callable[..., list[str]]  # grades the object, returns lines of information
    reference: str  # the project's own implementation, for check.py --solution
    speed: Callable[..., list[str]] | None = None  # information printed after a pass


# --- one rank of the checker: join the group, load the file, grade it, say how it went ---
def run_rank(exercise: Exercise, path: str, rank: int, world: int, hang_s: float,
             speed: bool = True) -> dict:
    """Grade the file at `path` on this rank. Return a record for check.py that JSON can hold."""
    obj = None
    try:
        if world > 1:
            with watching("the start of the process group"):
                dist.init_process_group("gloo", rank=rank, world_size=world,
                                        timeout=timedelta(seconds=hang_s + 30))
        # Before the file is loaded, so that `from torch.distributed import send` counts too.
        install_counters()
        with watching("the import of your file"):
            obj = load(path, exercise.names)
        info = exercise.check(obj)
        if speed and exercise.speed:
            info += exercise.speed(obj)
        return {"status": "pass", "info": info}
    except Failed as e:
        return {"status": "fail", "message": str(e)}
    except Exception as e:
        frames = traceback.extract_tb(e.__traceback__)
        frame = _frame_in(frames, path)
        if isinstance(e, NotImplementedError) and frame is not None and frame is frames[-1]:
            return {"status": "not_implemented", "where": _describe(frame),
                    "name": getattr(obj, "__name__", None)}
        where = _describe(frame)
        if isinstance(e, SyntaxError):  # a file that does not compile has no frame of its own
            where = {"file": os.path.basename(e.filename or path), "line": e.lineno,
                     "function": None, "code": (e.text or "").strip()}
        message = f"{type(e).__name__}: {e}".strip()
        return {"status": "error", "time": time.time(), "message": message, "where": where,
                "checker": None if where else _checker_frame(frames),
                "label": _watchdog.label if _watchdog else None}


def load(path: str, names: tuple[str, ...]) -> object:
    """Import the participant's file, and return the first of `names` that it defines.

    Its folder goes on sys.path, so that it may import its neighbours."""
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    name = "participant_" + os.path.basename(path).split(".")[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    for name in names:
        if hasattr(module, name):
            return getattr(module, name)
    raise Failed(f"{path} defines no {names[0]}. The checker grades that name, so keep the stub's "
                 "signature")


def _frame_in(frames, path):
    mine = [f for f in frames if os.path.abspath(f.filename) == os.path.abspath(path)]
    return mine[-1] if mine else None


def _describe(frame):
    if frame is None:
        return None
    return {"file": os.path.basename(frame.filename), "line": frame.lineno, "function": frame.name,
            "code": (frame.line or "").strip()}


def _checker_frame(frames):
    ours = [f for f in frames if not f.filename.startswith(os.path.dirname(torch.__file__))]
    return _describe(ours[-1]) if ours else None


# --- agreement across ranks: every rank learns the first failure and raises it together ---
# The checker's own collectives. install_counters wraps torch.distributed's; these stay uncounted.
uncounted_all_reduce = getattr(dist.all_reduce, "__wrapped__", dist.all_reduce)
uncounted_broadcast = getattr(dist.broadcast, "__wrapped__", dist.broadcast)
uncounted_all_gather = getattr(dist.all_gather, "__wrapped__", dist.all_gather)
_books = {}


def book():
    """A process group of the checker's own for the verdicts, apart from the participant's."""
    key = id(dist.group.WORLD)  # a new default group (the next init) needs a new one
    if key not in _books:
        _books[key] = dist.new_group(backend="gloo")
    return _books[key]


def agree(problem: str | None, label: str) -> None:
    """Raise Failed on every rank if any rank has a problem. The message names the lowest one."""
    if not dist.is_initialized():
        if problem:
            raise Failed(f"{label}: {problem}")
        return
    flag = torch.tensor([0 if problem is None else 1])
    uncounted_all_reduce(flag, op=dist.ReduceOp.MAX, group=book())
    if flag.item():
        problems = gather_objects(problem)
        r = next(k for k, p in enumerate(problems) if p)
        raise Failed(f"rank {r}, {label}: {problems[r]}")


def gather_objects(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=book())
    return out


def gather_tensors(x):
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    uncounted_all_gather(out, x.contiguous(), group=book())
    return out


def barrier():
    uncounted_all_reduce(torch.zeros(1), group=book())


def differs_from_rank0(named, hint):
    """A problem if any of the named tensors differs from rank 0's copy, bit for bit."""
    for name, t in named:
        ref = t.detach().contiguous().clone()
        uncounted_broadcast(ref, src=0, group=book())
        if not torch.equal(ref, t.detach()):
            i = first_difference(t.detach(), ref)
            return hinted(f"{name} differs from rank 0's at [{index_of(t, i)}]. Rank 0 has "
                          f"{num(ref.reshape(-1)[i])}, this rank {num(t.detach().reshape(-1)[i])}",
                          hint)
    return None


# --- counting what a solution sends: wrappers around torch.distributed's functions ---
KINDS = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv",
         "all_reduce": "collective", "broadcast": "collective", "all_gather": "collective",
         "all_gather_into_tensor": "collective", "all_gather_single": "collective",
         "reduce_scatter_tensor": "collective", "reduce_scatter_single": "collective"}


@dataclass
class Call:
    """One call into torch.distributed, as the recorder saw it."""

    op: str
    numel: int
    nbytes: int
    async_op: bool
    phase: str
    ready: int  # gradients ready when it was launched (see count_ready)
    abs_sum: float  # all_reduce: sum of |x| at launch (was the bucket multiplied by 1/N first?)
    peer: int | None = None  # send/recv: the peer rank (None: a recv from any source)
    work: object = None
    tensor: torch.Tensor | None = None  # all_reduce: the tensor it reduces in place
    version: int | None = None  # its version counter at launch; None for a view of a larger buffer
    raced: bool = False  # changed in place while its asynchronous all-reduce ran

    def describe(self):
        """What this rank is doing, in words: 'sending 5 elements to rank 2'."""
        if KINDS[self.op] == "send":
            return f"sending {self.numel} elements to rank {self.peer}"
        if KINDS[self.op] == "recv":
            peer = "any rank" if self.peer is None else f"rank {self.peer}"
            return f"receiving {self.numel} elements from {peer}"
        return f"in dist.{self.op} of {self.numel} elements"


class Tracked:
    """A Work handed to the participant. It notes whether anyone waited for it.

    For a hang report, it also notes which call the rank waits for."""

    def __init__(self, work, call, recorder):
        self._work, self.waited, self._call, self._recorder = work, False, call, recorder

    def wait(self, *args, **kwargs):
        self.waited = True
        call = self._call
        # A change in place before wait(), such as p.grad /= world, races with the reduction.
        # Autograd and in-place ops bump a tensor's version counter. gloo's result does not.
        if call.version is not None and call.tensor._version != call.version:
            call.raced = True
        self._recorder.waiting = call
        try:
            result = self._work.wait(*args, **kwargs)
        except BaseException:
            self._recorder.failed = call
            raise
        finally:
            self._recorder.waiting = None
        return result

    def get_future(self):
        self.waited = True  # whoever takes the future waits through it
        return self._work.get_future()

    def __getattr__(self, name):
        return getattr(self._work, name)


class Recorder:
    """The calls one rank made inside one recording(), and where it is now."""

    def __init__(self, ready=None, lockstep=None, name_of=None):
        self.calls, self.phase, self.ready, self.inside = [], "forward", ready, False
        self.waiting = None  # the call whose blocking function, or whose wait(), the rank is in
        self.failed = None  # the call whose blocking function, or wait(), raised (a timeout)
        self.lockstep, self.name_of = lockstep, name_of or (lambda t: "a tensor")

    def in_step(self, op=None, tensor=None):
        """In lockstep, every rank says which collective comes next (op=None: none, it returned).

        When the ranks differ, every rank raises Failed at once, with self.lockstep's words. So gloo
        never pairs two different collectives, and no rank waits for one that never comes."""
        if self.lockstep is None:
            return
        k = sum(KINDS[c.op] == "collective" for c in self.calls) + 1  # this rank's k-th collective
        what = (k, op, 0 if tensor is None else tensor.numel(),
                "None" if tensor is None else self.name_of(tensor))
        self.inside = True  # all_gather_object calls all_gather, which is not the participant's
        try:
            said = gather_objects(what)
        finally:
            self.inside = False
        if any(s[1:3] != said[0][1:3] for s in said):
            raise Failed(self.lockstep(said))

    def count(self, kind):
        return sum(1 for c in self.calls if KINDS[c.op] == kind)

    def bytes(self, kind):
        return sum(c.nbytes for c in self.calls if KINDS[c.op] == kind)

    def names(self, kind):
        return sorted({f"dist.{c.op}" for c in self.calls if KINDS[c.op] == kind})

    def calls_of(self, op):
        return [c for c in self.calls if c.op == op]


_recorder = _last = None  # the recording now, and the latest one (for a hang report)


@contextlib.contextmanager
def recording(ready: list | None = None, lockstep: Callable[[list], str] | None = None,
              name_of: Callable[[torch.Tensor], str] | None = None):
    """Record the calls into torch.distributed made inside. `ready` (from count_ready) counts grads.

    With `lockstep`, the ranks compare each collective before it runs (Recorder.in_step).
    `lockstep(said)` words a mismatch, and `name_of(tensor)` names a tensor in it. Call
    rec.in_step() once the participant's code has returned."""
    global _recorder, _last
    _recorder = _last = Recorder(ready, lockstep, name_of)
    if ready is not None:
        ready[0] = 0
        ready[1].clear()
    try:
        yield _recorder
    finally:
        _recorder = None


def count_ready(module):
    """Hooks that count the gradients autograd has made so far, ahead of the participant's."""
    ready = [0, []]  # how many so far, and their names in arrival order
    names = {p: n for n, p in module.named_parameters()}

    def hook(p):
        ready[0] += 1
        ready[1].append(names[p])

    for p in module.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(hook)
    return ready


def _counted(op, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        rec = _recorder
        if rec is None or rec.inside:  # torch's send calls isend: count the outer call only
            return fn(*args, **kwargs)
        t = args[0] if args else next((v for v in kwargs.values() if torch.is_tensor(v)), None)
        if isinstance(t, list):  # all_gather's list of outputs: count its input instead
            t = args[1] if len(args) > 1 else kwargs.get("tensor")
        if not torch.is_tensor(t):
            t = torch.empty(0)
        call = Call(op, t.numel(), t.numel() * t.element_size(),
                    async_op=bool(kwargs.get("async_op", op in ("isend", "irecv"))),
                    phase=rec.phase, ready=rec.ready[0] if rec.ready else 0,
                    abs_sum=t.detach().double().abs().sum().item() if op == "all_reduce" else 0.0,
                    peer=_peer(op, args, kwargs))
        if op == "all_reduce":
            # Views of one buffer share a version counter, so a write to another view is no race.
            call.tensor, call.version = t, (t._version if t._base is None else None)
        if KINDS[op] == "collective":
            rec.in_step(op, None if args and args[0] is None else t)
        rec.calls.append(call)
        rec.inside, rec.waiting = True, call
        try:
            work = fn(*args, **kwargs)
        except BaseException:
            rec.failed = call
            raise
        finally:
            rec.inside, rec.waiting = False, None
        if (op == "all_reduce" or KINDS[op] in ("send", "recv")) and work is not None:
            work = call.work = Tracked(work, call, rec)
        return work
    wrapper.counted = True
    return wrapper


def _peer(op, args, kwargs):
    """The rank a send goes to, or a recv comes from.

    batch_isend_irecv passes group_dst or group_src. On the default group, they are the same."""
    if KINDS[op] not in ("send", "recv"):
        return None
    key = "dst" if KINDS[op] == "send" else "src"
    peer = args[1] if len(args) > 1 else kwargs.get(key, kwargs.get(f"group_{key}"))
    return peer if isinstance(peer, int) else None


def install_counters() -> None:
    """Replace torch.distributed's messages and collectives with counting ones, once.

    They count only inside recording(). Both namespaces change, since batch_isend_irecv checks
    `op is isend` in distributed_c10d."""
    for op in KINDS:
        fn = getattr(dist, op, None)
        if fn is None or getattr(fn, "counted", False):
            continue
        wrapped = _counted(op, fn)
        setattr(dist, op, wrapped)
        if getattr(c10d, op, None) is fn:
            setattr(c10d, op, wrapped)


# --- the watchdog: a hang becomes the place where each rank waits ---
_watchdog = None


def watching(label: str):
    """Watch the calls inside, under this label. Without a watchdog, do nothing."""
    return _watchdog.watch(label) if _watchdog else contextlib.nullcontext()


class Watchdog:
    """A thread that writes down where the main thread is, as a record in `out`.

    It does so when the main thread has spent more than hang_s seconds in one watched call, or when
    check.py asks by creating `request`. The place is the innermost line of `participant`."""

    def __init__(self, hang_s, out, request, participant):
        self.hang_s, self.out, self.request = hang_s, out, request
        self.participant = os.path.abspath(participant)
        self.label, self.since, self.main = None, None, threading.main_thread().ident
        threading.Thread(target=self._run, daemon=True).start()

    @contextlib.contextmanager
    def watch(self, label):
        self.label, self.since = label, time.monotonic()
        try:
            yield
        finally:
            self.since = None

    def _run(self):
        while True:
            time.sleep(0.05)
            since = self.since
            late = since is not None and time.monotonic() - since > self.hang_s
            if late or os.path.exists(self.request):
                self._dump(since)
                return

    def _dump(self, since):
        frame = sys._current_frames().get(self.main)
        stack = traceback.extract_stack(frame) if frame is not None else []
        mine = _frame_in(stack, self.participant)
        ours = [f for f in stack if os.path.abspath(f.filename) in CHECKER_FILES]
        record = hang_record(_describe(mine), _describe(ours[-1]) if ours else None)
        record.update(label=self.label if since is not None else None,
                      waited_s=None if since is None else round(time.monotonic() - since, 1))
        tmp = self.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, self.out)


def hang_record(where: dict | None, checker: dict | None) -> dict:
    """Where this rank waits, and for what. check.py's diagnosis reads one per rank.

    `where` is the participant's line, from _describe. `checker` is the checker's line, when the
    participant's code had returned. The record adds the call the rank is in (or whose timeout it
    raised), and the collectives it issued in the latest recording."""
    rec = _recorder or _last
    call = rec and (rec.waiting or rec.failed)
    issued = [[c.op, c.numel] for c in rec.calls if KINDS[c.op] == "collective"] if rec else []
    return {"status": "hang", "where": where, "checker": checker,
            "call": call and {"op": call.op, "kind": KINDS[call.op], "peer": call.peer,
                              "numel": call.numel, "text": call.describe()},
            # ranks that issued different collectives wait for each other forever
            "collectives": issued}


def start_watchdog(hang_s: float, out: str, request: str, participant: str) -> None:
    global _watchdog
    _watchdog = Watchdog(hang_s, out, request, participant)


# --- small helpers for messages ---
def dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def num(x):
    v = x.item() if torch.is_tensor(x) else x
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def kind_of(obj):
    return "None" if obj is None else f"a {type(obj).__name__}"


def index_of(t, i):
    """Flat index i as an index into t's shape."""
    if t.dim() <= 1:
        return str(i)
    idx = []
    for size in reversed(t.shape):
        idx.append(i % size)
        i //= size
    return ", ".join(map(str, reversed(idx)))


def first_difference(a, b, close_enough=False, tol=0.0):
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    if close_enough:
        differs = ~torch.isclose(a.double(), b.double(), rtol=tol, atol=tol)
    else:
        differs = a != b
    hits = differs.nonzero()
    return int(hits[0]) if len(hits) else 0


def brief(indices, shown=12):
    if len(indices) <= shown:
        return str(indices)
    return str(indices[:shown])[:-1] + f", ... ({len(indices)} in all)]"
