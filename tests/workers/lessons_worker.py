"""Run under torchrun: 01-04 in one job, each as a learner runs it, with receives that land at wait().

Usage: lessons_worker.py JSON, a list of argument lists, each starting with the script's name.

Each lesson runs through its own run(main, parse_args), with its flags, in the one process group that
this worker makes. A group cannot be made twice in one job, so the lessons' init_process_group and
destroy_process_group do nothing here. A receive posted with irecv (alone, or in batch_isend_irecv)
writes into its tensor only when wait() is called. The library allows that, as the latest moment, so
code that reads a receive buffer before waiting reads stale memory every time, not only under load.
Rank 0 prints one line per run, RUN {"argv": [...], "outputs": [each rank's output]}, for the test.
"""

import contextlib
import io
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import load_script  # noqa: E402


class Late:
    """A receive's handle. Its message reaches the caller's tensor at wait(), not before."""

    def __init__(self, work, landing, into):
        self.work, self.landing, self.into = work, landing, into

    def arrive(self):  # wait for the message itself (gloo's handles may be waited on once)
        if self.work is not None:
            self.work.wait()
            self.work = None

    def wait(self, *args, **kwargs):
        self.arrive()
        self.into.copy_(self.landing)
        return True


def receive_late():
    """irecv delivers at wait() only (P2POp and batch_isend_irecv look it up in c10d, the lessons in
    dist); then a check of this worker itself, that a message waits in the landing buffer until wait()."""
    real = c10d.irecv

    def irecv(tensor, *args, **kwargs):
        landing = torch.empty_like(tensor)
        return Late(real(landing, *args, **kwargs), landing, tensor)

    dist.irecv = c10d.irecv = irecv
    rank, world = dist.get_rank(), dist.get_world_size()
    got = torch.full((4,), -1.0)
    req = dist.irecv(got, src=(rank - 1) % world)
    sent = dist.isend(torch.full((4,), float(rank)), dst=(rank + 1) % world)
    req.arrive()  # the message is in the landing buffer now
    sent.wait()
    untouched = torch.equal(got, torch.full((4,), -1.0))
    req.wait()
    assert untouched and torch.equal(got, torch.full((4,), float((rank - 1) % world))), got


def main():
    runs = json.loads(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a planted deadlock ends in 60 s
    receive_late()
    destroy = dist.destroy_process_group
    dist.init_process_group = lambda *args, **kwargs: None
    dist.destroy_process_group = lambda *args, **kwargs: None
    for argv in runs:
        lesson = load_script(argv[0])
        sys.argv = [*argv, "--device", "cpu"]
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                lesson.run(lesson.main, lesson.parse_args)
        except BaseException:  # a failed check: what the lesson printed, then its traceback
            print(f"[worker] rank {dist.get_rank()}, {' '.join(argv)}:\n{out.getvalue()}", flush=True)
            raise
        outputs = [None] * dist.get_world_size()
        dist.all_gather_object(outputs, out.getvalue())
        if dist.get_rank() == 0:
            print("RUN " + json.dumps({"argv": argv, "outputs": outputs}), flush=True)
    destroy()


if __name__ == "__main__":
    main()
