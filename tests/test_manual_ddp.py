"""ddp_dropin.ManualDDP (05's DDPCore with DDP's surface) as a drop-in for torch.nn.parallel.DistributedDataParallel:
its arguments, its numbers, its uses."""

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


def test_05_opens_on_the_naive_version_then_the_core_and_the_drop_in_replaces_whole_methods():
    """05's first definition is the naive average_gradients, its second DDPCore, a class of about 150 lines that
    holds no ManualDDP and nothing for it: every method of the core is used by 05 itself, and ddp_dropin.py's
    ManualDDP, a subclass of 05's DDPCore (loaded, not copied), extends none of them through super(). The idea (the
    naive version, the core and its helpers) and the training loop are at least half of 05; every page that gives
    the core's size ("the N-line class") gives its real size, 05's docstring and docs/ddp.md among them."""
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
    assert [b.id for b in manual.bases] == ["DDPCore", "Joinable"]
    assert not any(isinstance(n, ast.ClassDef) and n.name == "DDPCore" for n in dropin.body), "the core is copied"
    assert load_script("ddp_dropin.py").DDPCore is sys.modules["manual_ddp_gpt2"].DDPCore
    extended = [m.name for m in manual.body if isinstance(m, ast.FunctionDef) and m.name in methods
                and any(isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id == "super"
                        for c in ast.walk(m))]
    assert not extended, f"ManualDDP extends the core's {extended} through super(): the core has hooks for it"
    pages = [launch.REPO / "05_manual_ddp_gpt2.py", launch.REPO / "README.md", launch.REPO / "WORKSHOP.md",
             *(launch.REPO / "docs").glob("*.md")]
    said = {page.name: {int(n) for n in re.findall(r"\b(\d+)-line class\b", page.read_text())} for page in pages}
    assert said["05_manual_ddp_gpt2.py"] and said["ddp.md"], said
    assert all(found <= {size} for found in said.values()), (size, said)


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
