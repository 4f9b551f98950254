"""debug_tools.check_replicas on every rank under torchrun: quiet on identical replicas (plain, DDP- and
ManualDDP-wrapped); on a difference on some ranks, the same RuntimeError on every rank naming the tensor (a parameter,
a buffer, a frozen parameter, a plain tensor attribute, one in a list or a dict, the optimizer's state), the ranks and
the largest difference; a different lr, eval mode, shape or a missing tensor named, not crashed on; on 3 ranks, a
group without global rank 0. BatchNorm's statistics after a step: reported, not raised, where DDP's broadcast_buffers
overwrites them; raised, with what to do, where nothing does; not compared when ignored. A resume that loads the
optimizer's state on rank 0 only: every difference counted, the optimizer's state listed before the parameters it
made drift."""

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: debug_tools, ddp_dropin
from ddp_dropin import ManualDDP  # noqa: E402
from debug_tools import check_replicas  # noqa: E402


def model(dtype=torch.float32):
    torch.manual_seed(0)  # the same replica on every rank
    m = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2)).to(dtype)
    m[2].requires_grad_(False)  # frozen: still part of the replica
    return m


def plus_one_ulp(t):  # the smallest change a dtype can hold
    t.copy_(torch.nextafter(t, torch.full_like(t, torch.inf)))


def trained(wrapper, rank, bn=False, steps=1):
    """Steps of `wrapper` on this rank's own batches, with momentum: identical replicas, optimizer state included,
    but for BatchNorm's running statistics: DDP copies rank 0's at the start of each forward, not after it."""
    torch.manual_seed(0)
    m = wrapper(model() if bn else nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(rank)
    for _ in range(steps):
        opt.zero_grad()
        m(torch.randn(8, 4)).sum().backward()
        opt.step()
    return m, opt


def resumed_on_rank_0_only():
    """A resume in which only rank 0 loads the optimizer's state (the model comes from DDP's broadcast), then a step:
    the momentum differs (the cause) and so do the parameters (the symptom)."""
    saved = copy.deepcopy(trained(DDP, rank, steps=2)[1].state_dict())  # the checkpoint's optimizer state
    m, opt = trained(DDP, rank)
    if rank == 0:
        opt.load_state_dict(saved)
    torch.manual_seed(rank)
    m(torch.randn(8, 4)).sum().backward()
    opt.step()
    return m, opt


def causes_first(message):
    """The resume's message: a count by kind, then the optimizer's state, then the parameters."""
    lines = message.splitlines()
    return lines[1].startswith("  optimizer state[module.0.weight]['momentum_buffer'] (float32, (3, 4)) on rank(s)") \
        and lines[4] == "  ... 1 more optimizer state (the exception's .differences lists all)" \
        and lines[5].startswith("  module.0.weight (float32, (3, 4)) on rank(s)")


def bn_forward():
    """A forward on this rank's own batch, no step: only BatchNorm's running statistics differ."""
    m = model()
    torch.manual_seed(rank)
    m(torch.randn(8, 4))
    return m


def with_attr(name, value):
    m = model()
    setattr(m[0], name, value)  # a plain attribute: neither parameter nor buffer
    return m


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
last, others = [world - 1], list(range(1, world))
mine = torch.randn(5, generator=torch.Generator().manual_seed(rank))  # a different tensor on every rank


def momentum_off(m_opt):
    m, opt = m_opt
    if rank in last:
        opt.state[m.module[0].weight]["momentum_buffer"].add_(1.0)
    return m, opt


def lr_off(m_opt):
    m, opt = m_opt
    opt.param_groups[0]["lr"] = 0.05 if rank in last else 0.1
    return m, opt


CASES = [  # (name, the model (or model, optimizer[, ignore]) on this rank, ranks that differ, what the error must say
    # or None: no error[, a pattern the message must match too])
    ("identical", lambda: model(), [], None),
    ("a parameter", lambda: _changed(lambda m: m[0].weight.data[1, 2].add_(0.5), last), last, "differ: 0.weight "),
    ("a buffer", lambda: _changed(lambda m: m[1].running_var.add_(0.25), others), others, "differ: 1.running_var "),
    ("a frozen parameter", lambda: _changed(lambda m: m[2].bias.data.sub_(1.0), last), last, "differ: 2.bias "),
    ("bf16, one ulp", lambda: _changed(lambda m: plus_one_ulp(m[0].bias.data[:1]), last, torch.bfloat16), last,
     "differ: 0.bias (bfloat16"),
    ("fp16 -0.0", lambda: _changed(lambda m: m[1].running_mean.data.fill_(-0.0), last, torch.float16), last,
     "differ: 1.running_mean "),
    ("a plain tensor attribute, DDP", lambda: DDP(with_attr("proj", mine if rank in last else mine * 0 + 1)), last,
     "differ: module.0.proj (float32, (5,)) "),
    ("a tensor in a list", lambda: with_attr("masks", [torch.ones(2), mine if rank in others else torch.ones(5)]),
     others, "differ: 0.masks[1] "),
    ("a tensor in a dict", lambda: with_attr("cache", {"k": mine if rank in last else torch.zeros(5)}), last,
     "differ: 0.cache['k'] "),
    ("identical, DDP after a step", lambda: trained(DDP, rank), [], None),
    ("identical, ManualDDP after a step", lambda: trained(ManualDDP, rank), [], None),
    ("BatchNorm's statistics after a DDP step: DDP overwrites them", lambda: trained(DDP, rank, bn=True), [],
     None, "2 buffer(s) differ by design, since DDP (broadcast_buffers=True) overwrites them with rank 0's as its next "
     "forward starts"),
    ("BatchNorm's statistics, ManualDDP", lambda: trained(ManualDDP, rank, bn=True), [], None, "2 buffer(s) differ"),
    ("BatchNorm's statistics, DDP(broadcast_buffers=False)", lambda: trained(lambda m: DDP(m, broadcast_buffers=False),
     rank, bn=True), others, "replicas differ in 2 places (buffers 2)\n", "DDP with broadcast_buffers=False (or "
     "forward_sync_buffers=False) does not copy them"),
    ("BatchNorm's statistics, no wrapper", bn_forward, others, "replicas differ in 2 places (buffers 2)\n",
     "nothing copies them"),
    ("BatchNorm's statistics, no wrapper, ignored", lambda: (bn_forward(), None, ["*.running_mean", "*.running_var"]),
     [], None, "ignored: 1.running_mean, 1.running_var"),
    ("a resume that loads the optimizer's state on rank 0 only", resumed_on_rank_0_only, others,
     "replicas differ in 8 places (optimizer state 4, parameters 4), the optimizer's state and settings first",
     causes_first),
    ("the optimizer's momentum", lambda: momentum_off(trained(DDP, rank)), last,
     "differ: optimizer state[module.0.weight]['momentum_buffer'] "),
    ("the optimizer's lr", lambda: lr_off(trained(DDP, rank)), [], "differ: optimizer param_groups[0]['lr'] is 0.1 "
     f"on rank 0, {'0.1 on rank 1, ' if world > 2 else ''}0.05 on rank {world - 1}"),
    ("eval mode on rank 0", lambda: model().train(rank != 0), [], "differ: the model is in eval mode on rank(s) [0] "
     "only"),
    ("a shape", lambda: with_attr("proj", torch.zeros(3 if rank in last else 4)), [],
     "differ: 0.proj has a different dtype or shape: rank 0 float32 (4,)"),
    ("a tensor on rank 0 only", lambda: with_attr("extra", torch.zeros(2) if rank == 0 else None), [],
     "differ: 0.extra exists on rank(s) [0] only"),
]


def _changed(change, ranks, dtype=torch.float32):
    m = model(dtype)
    if rank in ranks:
        change(m)
    return m


failures = []
for name, build, ranks, expected, *also in CASES:
    built = build()
    m, opt, ignore = (*built, ())[:3] if isinstance(built, tuple) else (built, None, ())
    try:
        message = check_replicas(m, opt, ignore=ignore)
        differed = False
    except RuntimeError as e:
        message, differed = str(e), True
    messages = [None] * world
    dist.all_gather_object(messages, message)
    if len(set(messages)) != 1:
        failures.append(f"{name}: not the same verdict on every rank: {messages}")
    elif expected is None and (differed or "not compared: RNG states" not in message):
        failures.append(f"{name}: {message}")
    elif expected is not None and not (differed and expected in message and (not ranks or f"rank(s) {ranks} " in
                                                                             message)):
        failures.append(f"{name}: expected {expected!r} and rank(s) {ranks}, got: {message}")
    elif also and not (also[0](message) if callable(also[0]) else also[0] in message):
        failures.append(f"{name}: expected {also[0]!r} too, got: {message}")
    if rank == 0:
        print(f"{name}: {message}", flush=True)
cases = len(CASES)
if world > 2:  # a group without global rank 0, whose own rank 0 is global rank 1
    cases += 1
    ones, message = dist.new_group(list(range(1, world))), None
    if rank > 0:
        try:
            message = check_replicas(_changed(lambda m: m[0].weight.data[1, 2].add_(0.5), last), group=ones)
        except RuntimeError as e:
            message = str(e)
    messages = [None] * world
    dist.all_gather_object(messages, message)  # one verdict on every rank
    expected = f"differ: 0.weight (float32, (3, 4)) on rank(s) [{world - 2}] differs from rank 0's by up to 0.5"
    if not all(expected in m for m in messages[1:]):
        failures.append(f"a group of ranks 1 to {world - 1}: {messages[1:]}")
dist.destroy_process_group()
if rank == 0:
    print("\n".join(failures) or f"OK check_replicas on {world} ranks: {cases} cases", flush=True)
sys.exit(1 if failures else 0)
