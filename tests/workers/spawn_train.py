"""A training job written the way PyTorch's DDP tutorial writes one, to debug with debug_tools.py alone
(tests/test_debugging.py): mp.spawn starts the ranks (so no RANK in their environment), or torchrun, or plain
processes with RANK set (then it runs the one rank it is); a DataLoader with worker processes feeds each rank;
BatchNorm in the model; check_replicas every 4 steps. --bug plants one mistake:

  rank0-barrier  rank 0 alone enters a barrier at step 1 (a checkpoint's barrier in its `if rank == 0:`): a hang
  resume-rank0   resuming from --ckpt, only rank 0 loads the optimizer's state (the model loads on every rank)

  PYTHONPATH=. python tests/workers/spawn_train.py --world-size 2
  PYTHONPATH=. torchrun --nproc_per_node=2 tests/workers/spawn_train.py
"""

import argparse
import functools
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from debug_tools import check_replicas


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.bn = nn.BatchNorm1d(10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.bn(self.net1(x))))


def setup(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=300))


def announce(rank, worker_id):  # each DataLoader worker says who it is: the tests debug it by pid
    print(f"rank {rank} worker {worker_id} pid {os.getpid()}", flush=True)


def demo_basic(rank, world_size, args):
    setup(rank, world_size, args.port)
    print(f"rank {rank} pid {os.getpid()}", flush=True)
    torch.manual_seed(0)
    model = ToyModel()
    if args.bug == "resume-rank0":
        ckpt = torch.load(args.ckpt)
        model.load_state_dict(ckpt["model"])
    ddp_model = DDP(model, broadcast_buffers=not args.no_broadcast_buffers)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.01, momentum=0.9)
    if args.bug == "resume-rank0" and rank == 0:
        optimizer.load_state_dict(ckpt["optimizer"])  # BUG: every rank must load it
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 10, generator=g), torch.randn(256, 5, generator=g))
    loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data), num_workers=2,
                        worker_init_fn=functools.partial(announce, rank))
    for step, (x, y) in enumerate(loader):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(ddp_model(x), y)
        loss.backward()
        optimizer.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if step % 4 == 0:
            print(f"rank {rank} {check_replicas(ddp_model, optimizer)}", flush=True)
        if args.bug == "rank0-barrier" and rank == 0 and step == 1:
            torch.save(ddp_model.state_dict(), os.devnull)
            dist.barrier()  # BUG: meant for every rank
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--port", type=int, default=12355)
    parser.add_argument("--bug", default="none", choices=["none", "rank0-barrier", "resume-rank0"])
    parser.add_argument("--ckpt", help="resume-rank0: a checkpoint {'model', 'optimizer'}")
    parser.add_argument("--no-broadcast-buffers", action="store_true")
    args = parser.parse_args()
    if "RANK" in os.environ:  # torchrun, or plain processes: this process is one rank
        args.port = int(os.environ["MASTER_PORT"])
        demo_basic(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    else:
        mp.spawn(demo_basic, args=(args.world_size, args), nprocs=args.world_size, join=True)
