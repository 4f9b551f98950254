"""A training script written as nanoGPT's train.py is: module-level code, the wrapper alive until the interpreter
exits, destroy_process_group() as the last line. Argument: core (05's DDPCore), manual (ddp_dropin's ManualDDP), zero
(07's ZeroDDP), or torch-via-run (PyTorch's DDP, ended by the scripts' run()).

FORCE_IDLE=1 makes the exit race it checks happen every time instead of once in several launches: each rank runs on
one core and gloo's threads (started by init_process_group) get SCHED_IDLE, so they run only while the main thread
waits. A gloo Work whose last reference is dropped by gloo's thread then gets freed late, during interpreter
shutdown, when that thread can no longer take the GIL: "terminate called without an active exception" (SIGABRT).
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import load_script  # noqa: E402

if os.environ.get("FORCE_IDLE") == "1":
    os.sched_setaffinity(0, {int(os.environ["RANK"]) % os.cpu_count()})  # before init: gloo's threads inherit it
    before = set(os.listdir("/proc/self/task"))
dist.init_process_group("gloo")
if os.environ.get("FORCE_IDLE") == "1":
    for tid in set(os.listdir("/proc/self/task")) - before:
        os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))

torch.manual_seed(dist.get_rank())
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
kind = sys.argv[1]


def train(ddp, opt):
    for _ in range(5):
        ddp(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    if dist.get_rank() == 0:
        print(f"OK {kind}: 5 steps, exiting", flush=True)


if kind == "torch-via-run":
    # PyTorch's own DDP, ended as every numbered script ends: the setup block's run() (destroy, then a moment for
    # gloo's threads). PyTorch's DDP cannot keep its Works alive for us, so this is the scripts' whole defence.
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    load_script("01_send_recv.py").run(lambda args: train(ddp, opt), lambda: None)  # it ends with the destroy
    sys.exit(0)
if kind == "zero":
    ddp = opt = load_script("07_zero.py").ZeroDDP(model, torch.optim.SGD, lr=0.1)
else:
    if kind == "core":
        ddp = load_script("05_manual_ddp_gpt2.py").DDPCore(model)
    else:
        ddp = load_script("ddp_dropin.py").ManualDDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
train(ddp, opt)
dist.destroy_process_group()
