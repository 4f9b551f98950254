"""An ordinary training loop, written as a reader writes one (not in this repository's style), with one planted bug
picked by --bug; the tests debug it with debug_tools.py alone (tests/test_debugging.py).

  uneven       the dataset split by rank leaves rank 0 a batch more: it waits in backward, the others in barrier
  seed         torch.manual_seed(rank) before the model is built: each rank its own initial weights
  eval-gather  rank 0 evaluates after epoch 0 and gathers the predictions; the others never reach the gather
  none         no bug

  torchrun --nproc_per_node=2 tests/workers/buggy_train.py --bug uneven --ddp
"""

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--bug", default="none", choices=["none", "uneven", "seed", "eval-gather"])
parser.add_argument("--ddp", action="store_true", help="PyTorch's DDP, else gradients averaged by hand")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--timeout", type=float, default=60, help="the process group's timeout, seconds")
parser.add_argument("--check", action="store_true", help="debug_tools.check_replicas after training")
parser.add_argument("--record", help="wrap the loop in debug_tools.flight_recorder(DIR)")
parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: GPU LOCAL_RANK mod the GPUs")
parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
args = parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.randn(16, 16) / 4  # a fixed random projection of the input: neither parameter nor buffer
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 1)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x @ self.proj)))


def evaluate(model, x, y):
    with torch.no_grad():
        pred = model(x)
    preds = [torch.zeros_like(pred) for _ in range(dist.get_world_size())]
    dist.all_gather(preds, pred)  # every rank's predictions
    return F.mse_loss(torch.cat(preds), y.repeat(dist.get_world_size(), 1)).item()


def train(model, opt, data):
    for epoch in range(args.epochs):
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            if not args.ddp:
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()
            opt.step()
            print(f"rank {rank} epoch {epoch} step {i} loss {loss.item():.4f}", flush=True)
        if args.bug == "eval-gather" and rank == 0:
            print(f"rank {rank} eval loss {evaluate(model, *data[0])}", flush=True)
    print(f"rank {rank} training done", flush=True)
    dist.barrier()  # wait for everyone before saving


device = torch.device("cpu")
if args.device == "cuda":
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    torch.cuda.set_device(device)
dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout))
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(rank if args.bug == "seed" else 0)
model = Net().to(device)
model.proj = model.proj.to(device)  # .to() moves parameters and buffers only
torch.manual_seed(100 + rank)  # each rank's own shuffling and dropout
if args.ddp:
    model = DDP(model)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
g = torch.Generator().manual_seed(0)
n = 8 * 3 * world + (8 if args.bug == "uneven" else 0)  # 3 batches of 8 per rank (uneven: one batch more)
xs, ys = torch.randn(n, 16, generator=g).to(device), torch.randn(n, 1, generator=g).to(device)
mine = list(range(rank * 8, n, world * 8))  # this rank's batches: every world-th block of 8
data = [(xs[s:s + 8], ys[s:s + 8]) for s in mine]
print(f"rank {rank} pid {os.getpid()} has {len(data)} batches", flush=True)
if args.record:
    from debug_tools import flight_recorder
    with flight_recorder(args.record, hang_s=3):  # a test: short waits count as hangs
        train(model, opt, data)
else:
    train(model, opt, data)
if args.check:
    from debug_tools import check_replicas
    print(f"rank {rank} {check_replicas(model, opt)}", flush=True)
dist.destroy_process_group()
