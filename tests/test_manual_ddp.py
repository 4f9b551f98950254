"""ddp_dropin.ManualDDP (05's DDPCore, written out with DDP's options) as a drop-in for
torch.nn.parallel.DistributedDataParallel: its arguments, its numbers, its uses."""

import copy
import inspect
import re
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
    assert list(ours)[:len(theirs)] == list(theirs), "not in DDP's order: positional calls would differ"
    differ = [n for n, p in theirs.items() if ours[n].default != p.default]
    assert not differ, f"defaults differ from DDP's: {differ}"
    extra = [n for n, p in ours.items() if n not in theirs]
    assert extra == ["verify"] and ours["verify"].kind is inspect.Parameter.KEYWORD_ONLY, extra
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ours.values()), "no **kwargs to hide typos"


@pytest.mark.slow  # 30 s (4 ranks on 2 cores); the quick tier keeps ManualDDP == DDP through test_zoo and test_clients
def test_drop_in_for_ddp_and_bit_identical_on_4_3_and_2_ranks():
    """One launch (its ranks forked from one process that imported torch and transformers' GPT-2, 5 s a rank
    otherwise: launches are what the suite pays for): the drop-in checks on 4 ranks, with subgroups inside, and
    exact_worker's step-by-step torch.equal against DDP on all 4 ranks, on a group of 3 and on pairs (the ring's order
    of summation differs at each size)."""
    res = launch.torchrun_forked("tests/workers/dropin_worker.py", {4: []}, preload=(
        "torch", "transformers.models.gpt2.modeling_gpt2"), timeout=300, device=None)[4]
    assert not res.timed_out and res.returncode == 0, res.output
    assert res.ok_line() and "bit-identical at every step on 4, a group of 3 and 2 ranks" in res.ok_line(), res.output


def test_05_opens_on_the_naive_version_then_the_core_and_the_drop_in_stands_beside_it():
    """05's first definition is the naive average_gradients, its second DDPCore, a class of about 150 lines that
    holds no ManualDDP and nothing for it: every method of the core is used by 05 itself. ddp_dropin.py's ManualDDP
    is no subclass of it (it writes out each step with DDP's options: test_manual_ddp_holds_all_the_core_holds) and
    does not copy it. The idea (the naive version, the core and its helpers) and the training loop are at least half
    of 05; every page that gives the core's size ("the N-line class") gives its real size, 05's docstring and
    docs/ddp.md among them."""
    import ast
    text = (launch.REPO / "05_manual_ddp_gpt2.py").read_text()
    tree = ast.parse(text)
    defs = [n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))]
    assert [d.name for d in defs[:2]] == ["average_gradients", "DDPCore"], [d.name for d in defs[:3]]
    top = {n.name: n for n in defs}
    core = top["DDPCore"]
    size = core.end_lineno - core.lineno + 1
    assert size <= 170, size
    assert "ManualDDP" not in top and "ddp_dropin.py" in ast.get_docstring(tree)
    lines = text.splitlines()
    def section(mark):  # the index of the first line that starts with this section mark
        return next(k for k, line in enumerate(lines) if line.startswith(mark))
    idea = section("# --- data") - section("# --- the idea")  # the naive version, DDPCore and its helpers
    loop = top["main"].end_lineno - section("# --- training")  # wrap, the schedule, the loop and its check
    assert 2 * (idea + loop) >= len(lines), (len(lines), idea, loop)  # the file's size: test_setup.py
    methods = [n.name for n in core.body if isinstance(n, ast.FunctionDef)]
    for name in methods:
        if name not in ("__init__", "forward", "no_sync"):  # the API; the rest must serve the core itself
            assert f".{name}(" in text or f".{name})" in text, f"DDPCore.{name} is not used by 05 itself"
    dropin = ast.parse((launch.REPO / "ddp_dropin.py").read_text())
    manual = next(n for n in dropin.body if isinstance(n, ast.ClassDef) and n.name == "ManualDDP")
    assert [ast.unparse(b) for b in manual.bases] == ["nn.Module", "Joinable"]
    assert not any(isinstance(n, ast.ClassDef) and n.name == "DDPCore" for n in dropin.body), "the core is copied"
    assert load_script("ddp_dropin.py").lesson is sys.modules["manual_ddp_gpt2"]  # its Bucket and layout
    pages = [launch.REPO / "05_manual_ddp_gpt2.py", launch.REPO / "README.md", launch.REPO / "WORKSHOP.md",
             *(launch.REPO / "docs").glob("*.md")]
    said = {page.name: {int(n) for n in re.findall(r"\b(\d+)-line class\b", page.read_text())} for page in pages}
    assert said["05_manual_ddp_gpt2.py"] and said["ddp.md"] and said["manual_ddp.md"], said
    assert all(found <= {size} for found in said.values()), (size, said)


def test_manual_ddp_holds_all_the_core_holds(group_of_one):
    """ManualDDP stands beside DDPCore: it writes out each of the core's steps with DDP's options, under the core's
    names. So every attribute a DDPCore sets, every method of the class and every attribute of its buckets must
    exist on ManualDDP too, and the simple ones must hold the same values after the same two steps (the second
    after the rebuild). A core that gains state or a step that ManualDDP lacks fails here. One process."""
    lesson, dropin = load_script("05_manual_ddp_gpt2.py"), load_script("ddp_dropin.py")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    core, manual = lesson.DDPCore(copy.deepcopy(model)), dropin.ManualDDP(copy.deepcopy(model))
    for wrapper in (core, manual):
        for _ in range(2):
            wrapper(torch.randn(3, 4)).sum().backward()
    lacks = [n for n in vars(core) if not hasattr(manual, n)]
    lacks += [f"{n}()" for n, v in vars(lesson.DDPCore).items() if callable(v) and not hasattr(manual, n)]
    lacks += [f"buckets[0].{n}" for n in vars(core.buckets[0]) if not hasattr(manual.buckets[0], n)]
    assert not lacks, f"DDPCore has {lacks}, ManualDDP does not"

    def simple(v):
        return isinstance(v, bool | int | float | str) or (isinstance(v, list) and all(map(simple, v)))
    differ = [n for n, v in vars(core).items() if simple(v) and getattr(manual, n) != v]
    differ += ["buckets"] * ([b.indices for b in core.buckets] != [b.indices for b in manual.buckets])
    assert not differ, f"DDPCore and ManualDDP disagree on {differ}"


def test_a_dropped_ddpcore_is_freed_and_its_hooks_stay_quiet(monkeypatch, group_of_one):
    """The core's hooks hold it by a weak reference: a wrapper dropped (the notebooks wrap one module again and
    again) is freed at once, and the next wrapper's backward sends one all-reduce per bucket, not one more per
    wrapper that came before. One process, a group of one."""
    import weakref
    dist = torch.distributed
    lesson = load_script("05_manual_ddp_gpt2.py")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    dropped = weakref.ref(lesson.DDPCore(model))
    assert dropped() is None, "the hooks keep a dropped DDPCore alive"
    sent, all_reduce = [], dist.all_reduce

    def counted(*args, **kwargs):
        sent.append(args[0].numel())
        return all_reduce(*args, **kwargs)
    monkeypatch.setattr(dist, "all_reduce", counted)
    again = lesson.DDPCore(model)
    again(torch.randn(3, 4)).sum().backward()
    assert sent == [sum(p.numel() for p in model.parameters())] and len(again.buckets) == 1, sent


def test_buckets_are_cut_as_pytorchs_and_leave_in_bucket_order(monkeypatch, group_of_one):
    """bucket_layout against PyTorch's own bucketing (the reducer's compute_bucket_assignment_by_size) over random
    sizes, dtypes, orders and caps, sizes landing exactly on a cap included: the same buckets, in the same order where
    one dtype leaves one bucket unfinished (with several, the reducer orders the unfinished ones by a hash). And the
    core launches buckets strictly in bucket order even when backward readies them in another order (ranks may see
    different orders; collectives are matched by issue order), each gradient added by autograd into its bucket slot
    (no copy). One process, a group of one."""
    import random
    dist = torch.distributed
    lesson = load_script("05_manual_ddp_gpt2.py")
    rng = random.Random(0)
    for _ in range(500):
        tensors = [torch.empty(rng.choice([1, 2, 4, 8, 16, 25, 64]), dtype=rng.choice([torch.float32, torch.float64]))
                   for _ in range(rng.randint(1, 10))]
        caps, order = rng.choice([[64], [64, 256], [100], [16, 32, 64], [4]]), rng.sample(range(len(tensors)),
                                                                                          len(tensors))
        theirs, _ = dist._compute_bucket_assignment_by_size([tensors[i] for i in order], caps, [False] * len(order),
                                                            order)
        ours = lesson.bucket_layout(tensors, order, caps)
        assert sorted(ours) == sorted(map(list, theirs)), (caps, order, ours, theirs)
        if len({t.dtype for t in tensors}) == 1:
            assert ours == list(map(list, theirs)), (caps, order, ours, theirs)

    class TwoBranches(torch.nn.Module):  # the branch computed last is the first whose gradients backward makes
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x, b_first):
            first, second = (self.b, self.a) if b_first else (self.a, self.b)
            y = first(x)
            return y + second(x)

    core = lesson.DDPCore(TwoBranches(), bucket_cap_mb=1e-9)  # after the rebuild: a bucket per parameter
    launched, all_reduce = [], dist.all_reduce

    def recorded(tensor, *args, **kwargs):
        launched.append(tensor.data_ptr())
        return all_reduce(tensor, *args, **kwargs)
    monkeypatch.setattr(dist, "all_reduce", recorded)
    in_place, ready = [], lesson.DDPCore._on_grad_ready

    def watched(self, i, p):  # autograd added the gradient into the bucket itself: nothing to copy
        bucket, slot = self._where[i]
        in_place.append(p.grad.data_ptr() == bucket.views[slot].data_ptr())
        return ready(self, i, p)
    monkeypatch.setattr(lesson.DDPCore, "_on_grad_ready", watched)
    for b_first in (False, False, True, False, True):  # the rebuild follows the first order; then it flips
        launched.clear()
        core.module.zero_grad(set_to_none=True)  # as 05's loop: no .grad before forward
        core(torch.randn(2, 4), b_first).sum().backward()
        assert launched == [b.flat.data_ptr() for b in core.buckets], (b_first, launched)
    assert len(core.buckets) == 4 and len(in_place) == 20 and all(in_place), in_place


class TwoHeads(torch.nn.Module):
    def __init__(self, both):
        super().__init__()
        self.both, self.body = both, torch.nn.Linear(8, 16)
        self.first, self.second = torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return self.first(h) + self.second(h) if self.both else self.first(h)  # else second: never used


@pytest.mark.filterwarnings("ignore:You passed find_unused_parameters=true")  # DDP's, with static_graph
def test_skip_all_reduce_unused_params_skips_the_buckets_ddp_skips(group_of_one):
    """skip_all_reduce_unused_params saves the all-reduce of a bucket whose parameters all went unused, and never
    more. DDP knows a parameter unused from each forward's graph with find_unused_parameters, or from the first
    backward with static_graph; without either it sends every bucket (ManualDDP once sent none then, so ranks
    trained on their own gradients, silently). For each setting of the three flags, on a model that uses every
    parameter and on one whose second head is never used, a counting communication hook sees as many buckets
    each step on ManualDDP as on DDP, every .grad is DDP's (None included), and a step with weight decay (which
    tells a None .grad from a zero one) leaves DDP's weights. One process; tests/workers/dropin_worker.py checks
    the bits on 4 ranks."""
    import itertools
    dropin = load_script("ddp_dropin.py")

    def count(state, bucket):
        state.append(bucket.index())
        return torch.distributed.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])
    for both, find, static, skip in itertools.product((True, False), repeat=4):
        if not (both or find or static):
            continue  # a parameter without a gradient and neither flag: DDP's error, test_zoo's concern
        kw = dict(find_unused_parameters=find, static_graph=static, skip_all_reduce_unused_params=skip,
                  bucket_cap_mb=1e-5)  # a bucket per tensor
        torch.manual_seed(0)
        base, seen = TwoHeads(both), {}
        for cls in (dropin.ManualDDP, torch.nn.parallel.DistributedDataParallel):
            model = cls(copy.deepcopy(base), **kw)
            sent = []
            model.register_comm_hook(sent, count)
            record = seen[cls] = []
            for step in range(3):  # static_graph rebuilds its buckets after the second
                sent.clear()
                model(torch.randn(3, 8, generator=torch.Generator().manual_seed(step))).square().sum().backward()
                record.append((len(sent), [None if p.grad is None else p.grad.clone() for p in model.parameters()]))
                with torch.no_grad():
                    for p in model.parameters():  # SGD with weight decay: a None .grad leaves p as it is
                        if p.grad is not None:
                            p -= 0.1 * (p.grad + 0.1 * p)
                        p.grad = None
            record.append([p.detach().clone() for p in model.parameters()])
        ours, theirs = seen.values()
        where = f"both heads used: {both}, {kw}"
        assert [n for n, _ in ours[:-1]] == [n for n, _ in theirs[:-1]], (where, ours, theirs)
        for (_, mine), (_, ref) in zip(ours[:-1], theirs[:-1]):
            assert [g is None for g in mine] == [g is None for g in ref], where
            assert all(g is None or torch.equal(g, h) for g, h in zip(mine, ref)), where
        assert all(map(torch.equal, ours[-1], theirs[-1])), where
