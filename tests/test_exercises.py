"""exercises/check.py is tested (issue #32): the project's own code passes every rung, the stubs say "not
implemented", planted mistakes fail with the message that names them, and a deadlock ends in bounded time.

A planted mistake is a small edit of a correct participant's solution (exercises/solutions/NAME.py), written
to a temporary folder. One check.py run per rung grades all of its files (the ranks are forked from one process that
imported torch once); the module's runs start together, two at a time (one check.py mostly keeps one core busy, and
a planted hang waits), and each test reads its own.
"""

import json
import sys

import pytest

import launch

SOLUTIONS = launch.REPO / "exercises" / "solutions"
PROJECT = {  # the project's own implementation of each rung
    "tree_broadcast": "02_broadcast.py",
    "ring_all_reduce": "03_all_reduce.py",
    "sampler": "04_sampler.py",
    "ddp_naive": "05_manual_ddp_gpt2.py",
    "ddp_overlap": "exercises/solutions/ddp_overlap.py",  # no numbered script stops at this rung
    "ddp_buckets": "05_manual_ddp_gpt2.py",
    "zero1": "07_zero.py",
}

# Correct solutions in other styles than the hints' (a participant's): each must pass its rung.
VARIANTS = {
    "ring_all_reduce": ["ring_all_reduce_batched.py"],  # dist.batch_isend_irecv
    "ddp_naive": ["ddp_naive_avg.py", "ddp_naive_async.py"],  # ReduceOp.AVG; async, waited for, then divided
    "ddp_overlap": ["ddp_overlap_futures.py"],  # futures, waited for in a queued callback
    "ddp_buckets": ["ddp_buckets_views.py"],  # .grad views into the buckets, re-pointed after zero_grad
    "zero1": ["zero1_whole.py"],  # whole parameters per rank, not flat shards
}
ARRIVAL_ORDER = [  # each bucket launched the moment it is full: in gradient-arrival order, not bucket order
    ("        while self.next < len(self.buckets) and self.buckets[self.next][2] == 0:\n"
     "            ps, flat, _ = self.buckets[self.next]",
     "        if self.buckets[self.where[p]][2] == 0:  # launched the moment it is full\n"
     "            ps, flat, _ = self.buckets[self.where[p]]"),
    ("        for work, (ps, flat, _) in zip(self.works, self.buckets):\n            work.wait()\n",
     "        for work in self.works:\n            work.wait()\n        for ps, flat, _ in self.buckets:\n")]
SKIP_MISSING = ("        if p.requires_grad:\n"
                "            if p.grad is None:  # no gradient on this rank: it joins the all-reduce with zeros\n"
                "                p.grad = torch.zeros_like(p)\n")
DIVIDE_FIRST = "        p.grad.div_(self.world)  # 1/N before the sum, as DDP: the mean without a second pass\n"
HANG_S = {"tree_broadcast": "5"}  # the rungs with a planted hang: each call may wait this long

# rung -> {mistake: ([(text in the solution, replaced by)], what the verdict must say[, its status: fail])}
MISTAKES = {
    "tree_broadcast": {
        "src ignored": ([("vrank = (rank - src) % world", "src, vrank = 0, rank")], "not the source's (src=1)"),
        "a line, not a tree": ([("    for k in range(math.ceil(math.log2(world))):",
                                 "    for peer in range(world * (rank == src)):\n"
                                 "        if peer != src:\n"
                                 "            dist.send(tensor, dst=peer)\n"
                                 "    if rank != src:\n"
                                 "        dist.recv(tensor, src=src)\n"
                                 "    for k in []:")],
                               "A binomial tree needs only ceil(log2 4) = 2 rounds"),
        "not in place": ([("    vrank = ", "    tensor = tensor.clone()\n    vrank = ")], "in place"),
        # the receiver's partner computed without src: from src=1 on, rank 1 sends to rank 2 while rank 2 waits
        # on rank 0; the report names each rank's peer and the pairs that do not match, with the tree's hint
        "partners that do not match": ([("src=(vrank - step + src) % world", "src=(vrank - step) % world")],
                                       "The pairs do not match: rank 0 receives from rank 1, but rank 1 sends to "
                                       "rank 2; rank 1 sends to rank 2, but rank 2 receives from rank 0", "hang"),
    },
    "ring_all_reduce": {
        "all-gather skipped": ([("for s in range(world - 1):  # all-gather", "for s in range(0):  # all-gather")],
                               "the all-gather phase seems missing"),
        "wrong chunk offset": ([("chunks[(rank - s - 1) % world]", "chunks[(rank - s + 1) % world]")],
                               "check the chunk indices"),
        "all-gather adds": ([("reqs = [dist.isend(send, right), dist.irecv(recv, left)]\n",
                              "inbox = recv.clone()\n"
                              "        reqs = [dist.isend(send, right), dist.irecv(inbox, left)]\n"),
                             ("    if flat.data_ptr()", "        recv += inbox\n    if flat.data_ptr()")],
                            "overwrites yours (copy_). It is not added"),
        "no copy back": ([("if flat.data_ptr() != tensor.data_ptr():", "if False:")], "copy the result back"),
    },
    "sampler": {
        "set_epoch ignored": ([("        self.epoch = epoch\n", "        pass\n")], "set_epoch(1) changed nothing"),
        "no padding": ([("indices += [indices[i % n] for i in range(self.total_size - n)]", "pass")],
                       "Is the padding missing?"),
        "a block per rank": ([("indices[self.rank:self.total_size:self.num_replicas]",
                               "indices[self.rank * self.num_samples:(self.rank + 1) * self.num_samples]")],
                             "every N-th index starting at r"),
        "seed per rank": ([("g.manual_seed(self.seed + self.epoch)",
                            "g.manual_seed(self.seed + self.epoch + self.rank)")], "the same permutation"),
        "another permutation": ([("indices = torch.randperm(n, generator=g).tolist()",
                                  "indices = torch.randperm(n, generator=g).flip(0).tolist()")],
                                "ranks together, your samplers yield the same samples as torch's"),
    },
    "ddp_naive": {
        "1/N forgotten": ([("            p.grad /= world\n", "")], "summed, not averaged"),
        "biases skipped": ([("if p.requires_grad:", "if p.dim() > 1:")], "fc1.bias.grad is this rank's own gradient"),
        "weights reduced": ([("dist.all_reduce(p.grad)", "dist.all_reduce(p.data)")], "changed the weights"),
        "a temporary reduced": ([("            dist.all_reduce(p.grad)\n            p.grad /= world\n",
                                  "            dist.all_reduce(p.grad / world)\n")],
                                "Your all-reduces summed temporary tensors (6 of them), never .grad itself"),
        "divided before wait()": ([("            dist.all_reduce(p.grad)\n            p.grad /= world\n",
                                    "            work = dist.all_reduce(p.grad, async_op=True)\n"
                                    "            p.grad /= world\n            work.wait()\n")],
                                  "fc1.weight.grad changed (divided?) while its asynchronous all-reduce still ran"),
        # fc2 has no gradient on rank 1 in the last step: skipping it there leaves the ranks' all-reduces out of
        # step (a hang, or gloo pairing different tensors); the ranks compare each one first and fail together
        "missing gradient skipped": ([(SKIP_MISSING, "        if p.grad is not None:\n")],
                                     "At all-reduce 3, rank 0 all-reduces fc2.weight.grad (1024 elements), but "
                                     "rank 1 all-reduces fc3.weight.grad (128 elements). In this step fc2.weight, "
                                     "fc2.bias had no gradient on rank 1"),
    },
    "ddp_overlap": {
        "after backward": ([("p.register_post_accumulate_grad_hook(self._launch)", "pass"),
                            ("        for work in self.pending:",
                             "        for p in self.module.parameters():\n"
                             "            self._launch(p)\n"
                             "        for work in self.pending:")],
                           "launched after backward"),
        "blocking in the hook": ([("self.pending.append(dist.all_reduce(p.grad, async_op=True))",
                                   "dist.all_reduce(p.grad)")], "blocking (async_op=False)"),
        "1/N forgotten": ([("        p.grad.div_(self.world)", "        pass")], "summed, not averaged"),
        "never waited": ([("            work.wait()", "            pass")], "never waited for"),
        "no broadcast": ([("            dist.broadcast(p.data, src=0)", "            pass")], "Broadcast rank 0's"),
        "divided after the launch": ([(DIVIDE_FIRST, ""),
                                      ("        self.pending.append(dist.all_reduce(p.grad, async_op=True))\n",
                                       "        self.pending.append(dist.all_reduce(p.grad, async_op=True))\n"
                                       "        p.grad.div_(self.world)\n")],
                                     "fc3.bias.grad changed (divided?) while its asynchronous all-reduce still ran"),
    },
    "ddp_buckets": {
        "buckets out of order": ([("for ps in self.buckets]", "for ps in reversed(self.buckets)]")],
                                 "buckets launched out of order"),
        "1/N forgotten": ([("            flat.mul_(1 / self.world)", "            pass")], "summed, not averaged"),
        "no_sync ignored": ([("        if not self.sync:\n            return\n", "")],
                            "launched during a backward inside no_sync()"),
        "1/N after the sum": ([("            flat.mul_(1 / self.world)", "            pass"),
                               ("            work.wait()\n",
                                "            work.wait()\n            flat.mul_(1 / self.world)\n")],
                              "went out undivided"),
        "1/N between launch and wait": ([("            flat.mul_(1 / self.world)  # 1/N before the sum, as DDP\n", ""),
                                         ("            self.works.append(dist.all_reduce(flat, group=self.group, "
                                          "async_op=True))\n",
                                          "            self.works.append(dist.all_reduce(flat, group=self.group, "
                                          "async_op=True))\n            flat.mul_(1 / self.world)\n")],
                                        "bucket 0 changed (divided?) while its asynchronous all-reduce still ran"),
        "launched as soon as full": (ARRIVAL_ORDER, "buckets launched in the order their gradients arrived, not in "
                                                    "bucket order"),
        # ranks that launch their buckets in different orders: gloo aborts the rank that got the larger bucket;
        # the verdict is that rank's line, not its peer's "Connection reset by peer"
        "another order on rank 1": ([("        self.where = {p: k",
                                      "        if dist.get_rank() == 1:\n            self.buckets.reverse()\n"
                                      "        self.where = {p: k")],
                                    "was aborted by gloo during step 1 of 4", "error"),
    },
    "zero1": {
        "shards not gathered": ([("        all_gather(self.flat, self.shard.detach().clone())\n", "")],
                                "all-gather the updated shards"),
        "1/N forgotten": ([("        grads.mul_(1 / self.world)\n", "")], "summed, not averaged"),
        "no sharding": ([("self.lo, self.hi = self.rank * self.size, (self.rank + 1) * self.size",
                          "self.lo, self.hi = 0, self.size * self.world"),
                         ("        all_gather(self.flat, self.shard.detach().clone())\n", "")],
                        "steps only this rank's shard"),
    },
}


def plant(name, edits, path):
    text = (SOLUTIONS / f"{name}.py").read_text()
    for old, new in edits:
        assert old in text, f"the mistake no longer applies to exercises/solutions/{name}.py: {old!r}"
        text = text.replace(old, new)
    path.write_text(text)
    return path


def check(name, files, tmp_path, *flags, timeout=240):
    """Run the checker on `files`; return its exit status, output and one verdict per file."""
    out = tmp_path / "verdicts.json"
    args = [sys.executable, "exercises/check.py", name, "--json", out, *flags]
    for f in files:
        args += ["--file", f]
    res = launch.run([str(a) for a in args], timeout=timeout)
    assert not res.timed_out, res.output
    return res, json.loads(out.read_text()) if out.exists() else None


def rung(name, folder):
    """check.py on a rung's files: ours, the solution, the stub, the variants, then each planted mistake."""
    variants = [SOLUTIONS / v for v in VARIANTS.get(name, [])]
    files = [launch.REPO / PROJECT[name], SOLUTIONS / f"{name}.py", launch.REPO / "exercises" / f"{name}.py"]
    files += variants
    files += [plant(name, m[0], folder / f"{name}_{k}.py") for k, m in enumerate(MISTAKES[name].values())]
    flags = ([] if name == "ring_all_reduce" else ["--no-speed"]) + (["--hang-s", HANG_S[name]]
                                                                      if name in HANG_S else [])
    return files, variants, *check(name, files, folder, *flags)


def deadlocking_ring(folder):
    """Blocking sends in a ring: every rank sends first and nobody receives."""
    blocking = plant("ring_all_reduce", [("reqs = [dist.isend(send, right), dist.irecv(inbox, left)]",
                                          "dist.send(send, right)\n        dist.recv(inbox, left)\n        reqs = []")],
                     folder / "blocking_ring.py")
    return blocking, *check("ring_all_reduce", [blocking], folder, "--hang-s", "3", "--no-speed", timeout=60)


@pytest.fixture(scope="module")
def checked(request, tmp_path_factory):
    """{test name: what its check.py run returned}, run ahead: the planted hang and the measured ring first."""
    def job(f):
        return lambda: f(tmp_path_factory.mktemp("check"))
    jobs = {f"test_checker_passes_ours_and_names_each_planted_mistake[{name}]": job(lambda d, name=name: rung(name, d))
            for name in ("tree_broadcast", "ring_all_reduce")}
    jobs["test_a_deadlocking_ring_ends_in_bounded_time_with_where_each_rank_waited"] = job(deadlocking_ring)
    jobs.update({f"test_checker_passes_ours_and_names_each_planted_mistake[{name}]": job(
        lambda d, name=name: rung(name, d)) for name in MISTAKES})  # the rest, in the tests' order
    jobs["test_checker_exits_zero_when_the_file_passes"] = job(lambda d: check("sampler", [], d, "--solution"))
    with launch.ahead(request, jobs) as futures:
        yield futures


@pytest.mark.parametrize("name", list(MISTAKES))
def test_checker_passes_ours_and_names_each_planted_mistake(name, checked, request):
    """One run per rung: the project's own code and a participant's solution pass; the untouched stub says "not
    implemented" and names its file; each planted mistake fails with the words that name it."""
    mistakes = MISTAKES[name]
    assert len(mistakes) >= 3
    files, variants, res, verdicts = checked[request.node.name].result()
    assert verdicts is not None and len(verdicts) == len(files), res.output
    assert res.returncode == 1, res.output  # not every file passes: non-zero
    for f, v in zip(files, verdicts):  # each file as it was given (here: absolute), never climbing out with ../
        assert str(f) in v["text"], v["text"]
    ours, solution, stub, *rest = verdicts
    for f, v in zip(variants, rest):
        assert v["status"] == "ok", f"{f.name}: {v['text']}"
    planted = rest[len(variants):]
    assert ours["status"] == "ok" and ours["text"].startswith(f"OK {name}"), ours["text"]
    assert solution["status"] == "ok", solution["text"]
    if name == "ring_all_reduce":  # a passing ring also hears its speed against the library's
        assert "busbw" in solution["text"] and "x the library" in solution["text"], solution["text"]
    assert stub["status"] == "not_implemented", stub["text"]
    assert "NOT IMPLEMENTED" in stub["text"] and f"exercises/{name}.py" in stub["text"], stub["text"]
    for (mistake, (_, says, *status)), v in zip(mistakes.items(), planted):
        assert v["status"] == (status or ["fail"])[0], f"{mistake}: {v['text']}"
        assert says in v["text"], f"{mistake}: {v['text']}"
        assert "\n  hint: " in v["text"], f"{mistake}: {v['text']}"
    if name == "ddp_naive":  # rung 4 has no hooks: its hints must not send anyone looking for them
        assert all("hook" not in v["text"] for v in planted), [v["text"] for v in planted]
    if name == "tree_broadcast":  # a tree's hint, not the ring's (whose ranks all send first)
        hang = planted[list(mistakes).index("partners that do not match")]["text"]
        assert "vrank v < step sends to v + step" in hang and "ring" not in hang, hang


def test_checker_exits_zero_when_the_file_passes(checked, request):
    res, (v,) = checked[request.node.name].result()
    assert res.returncode == 0 and v["status"] == "ok", res.output
    assert v["file"].endswith("04_sampler.py"), v


def test_a_deadlocking_ring_ends_in_bounded_time_with_where_each_rank_waited(checked, request):
    """Blocking sends in a ring: every rank sends first and nobody receives. The checker stops within --hang-s
    (plus a grace) and says, in one line, where each rank waited, and why."""
    blocking, res, (v,) = checked[request.node.name].result()
    line = next(n for n, text in enumerate(blocking.read_text().splitlines(), 1) if "dist.send(" in text)
    assert res.returncode == 1 and v["status"] == "hang", res.output
    first = v["text"].splitlines()[0]
    assert first.startswith("HANG") and "no progress for 3 s in case 1 of" in first, first
    for r in range(3):
        assert f"rank {r} waits at blocking_ring.py:{line} in ring_all_reduce" in first, first
    assert "Every rank waits in a send and none in a receive" in first, first
    assert "dist.send blocks until the receiving rank has posted its receive" in v["text"], v["text"]


def test_a_gloo_abort_is_told_by_the_rank_whose_error_is_the_cause():
    """gloo aborts the rank that received more bytes than it expected: that rank leaves no verdict, only gloo's
    last words in its output; its peer raises "Connection reset by peer". The verdict names the aborted rank, its
    line and the case, not the peer's lost connection (check.verdict on the records two such ranks leave)."""
    sys.path.insert(0, str(launch.REPO / "exercises"))
    import check
    reset = {"status": "error", "time": 1.0, "message": "RuntimeError: [../third_party/gloo/gloo/transport/tcp/"
             "pair.cc:534] Read error [127.0.0.1]:4242: Connection reset by peer", "where": None, "checker": None,
             "label": "case 3 of 144 (float32, shape (13,), integer-valued values)"}
    abort = ("terminate called after throwing an instance of 'gloo::EnforceNotMet'\n  what():  [enforce fail at "
             "pair.cc:464] op.preamble.length <= op.nbytes. 20 vs 16. Received data size doesn't match expected "
             "size. Is there a distributed collective mismatch in your code?\n")
    v = check.verdict("ring_all_reduce", "/x/mine.py", [None, reset], [None, None], [abort, ""], [-6, 0], 20,
                      "mine.py")
    assert v["status"] == "error", v
    first = v["text"].splitlines()[0]
    assert first.startswith("ERROR mine.py: rank 0 was aborted by gloo during case 3 of 144"), first
    assert "Received data size doesn't match expected size" in first and "reset" not in first, first
    assert "differ in size" in v["text"], v["text"]
