"""01-04: each script checks itself under 2 and 3 ranks; the hand-written pieces equal the library's."""

import re

import pytest
import torch.utils.data

import launch

SCRIPTS = {
    "01_send_recv.py": [],
    "02_broadcast.py": ["--src", "1"],
    "03_all_reduce.py": [],
    "04_sampler.py": [],
}


@pytest.mark.parametrize("name,nproc", [("01_send_recv.py", 2), ("02_broadcast.py", 3), ("03_all_reduce.py", 2),
                                        ("04_sampler.py", 2)])
def test_script_checks_itself(name, nproc):
    """Each script on 2 or 3 ranks (its errors and plain-python message: test_reliability's table)."""
    res = launch.torchrun(name, nproc, SCRIPTS[name], timeout=120)
    assert not res.timed_out and res.returncode == 0, res.output
    assert res.ok_line(), res.output
    # Per-rank lines must come from every rank, tagged "[rank r/N]", for the scripts that print them; 02 and 04 print
    # them in rank order (rank 0's line, then rank 1's, ..., before the next round), 01's ranks each print their own.
    tagged = per_rank_lines(res.output, nproc)
    if name in ("02_broadcast.py", "04_sampler.py"):
        assert tagged and [r for r, _ in tagged] == list(range(nproc)) * (len(tagged) // nproc), res.output
    if name == "01_send_recv.py":  # each rank: its torchrun variables (RANK r, WORLD_SIZE N), then one line per step
        rows = {r: re.search(r"RANK=(\d+) .*WORLD_SIZE=(\d+) ", text).groups() for r, text in tagged
                if text.startswith("RANK=")}
        assert rows == {r: (str(r), str(nproc)) for r in range(nproc)}, res.output
        for step in ("send/recv: ", "ring shift: got "):
            assert sorted(r for r, text in tagged if text.startswith(step)) == list(range(nproc)), res.output
        assert f"token ring: came back as {sum(range(nproc))}" in res.output, res.output
    if name == "02_broadcast.py":  # every rank starts with a tensor of its own and ends with src's
        before = [text for _, text in tagged if text.startswith("before dist.broadcast")]
        after = [text.split(": ", 1)[1] for _, text in tagged if text.startswith("after  dist.broadcast")]
        src = int(SCRIPTS[name][1])
        assert len(set(before)) == nproc and after == [before[src].split(": ", 1)[1]] * nproc, res.output
    if name == "04_sampler.py":  # with set_epoch, each epoch a new order
        epochs = [text.split(": ", 1)[1] for _, text in tagged if re.match(r"epoch \d:", text)]
        assert len(epochs) == 3 * nproc and len(set(epochs)) == len(epochs), res.output


def per_rank_lines(output, nproc):
    """(rank, text) of every line tagged "[rank r/N]", in the order printed."""
    found = [re.match(rf"\[rank (\d+)/{nproc}\] (.*)", ln) for ln in output.splitlines()]
    return [(int(m.group(1)), m.group(2)) for m in found if m]


@pytest.mark.parametrize("nproc", [2, pytest.param(3, marks=pytest.mark.slow)])  # 3 ranks on 2 cores: 12 s
def test_ring_all_reduce_matches_library(nproc):
    """Both of 03's rings graded as a participant's is (3 ranks: chunks of unequal size, sums of three terms whose
    order matters), and the pipelined one in pieces of one element up: the lesson's ring, bit for bit."""
    res = launch.run(launch.torchrun_cmd("tests/workers/ring_worker.py", nproc), timeout=240)
    assert not res.timed_out and res.returncode == 0, res.output
    assert res.output.count("graded 03's") == 2 and res.ok_line(), res.output


def test_imports_have_no_side_effects(script, capsys):
    import torch.distributed as dist
    ring = script("03_all_reduce.py").ring_all_reduce
    sampler = script("04_sampler.py").DistributedSampler
    assert callable(ring) and callable(sampler)
    assert not dist.is_initialized()
    assert capsys.readouterr().out == ""


def test_sampler_equals_torch_over_argument_grid(script):
    """exercises/grading.py's sampler check, the one a participant's sampler gets: every rank's indices equal
    torch's over sizes, replica counts, shuffle, seeds, drop_last and epochs."""
    script("exercises/grading.py").check_sampler(script("04_sampler.py").DistributedSampler)


@pytest.mark.parametrize("rank,replicas", [(3, 3), (-1, 2), (10, 4)])
def test_sampler_rejects_bad_rank_like_torch(script, rank, replicas):
    Ours = script("04_sampler.py").DistributedSampler
    with pytest.raises(ValueError):
        torch.utils.data.DistributedSampler(range(10), num_replicas=replicas, rank=rank)
    with pytest.raises(ValueError, match=f"Invalid rank {rank}") as ours:
        Ours(range(10), num_replicas=replicas, rank=rank)
    assert f"[0, {replicas - 1}]" in str(ours.value)


def test_ring_trace_on_3_ranks_adds_what_the_left_neighbour_held():
    """03 --trace: each step's line says which chunk came from the left; the value that arrived must be what the
    left neighbour held the step before (added in the reduce-scatter, copied in the all-gather), and every rank
    ends with the sum of the starting tensors, which is what dist.all_reduce gives (the script checks that too)."""
    n = 3
    res = launch.torchrun("03_all_reduce.py", n, ["--trace"], timeout=120)
    assert not res.timed_out and res.returncode == 0 and res.ok_line(), res.output
    steps = []  # per step: {rank: (holdings, phase verb, chunk received)}
    for rank, text in per_rank_lines(res.output, n):
        m = re.match(r"holds \[([^]]*)\](?:  sent chunk \d to rank \d, (added|copied) chunk (\d) from rank \d)?",
                     text)
        if rank == 0:
            steps.append({})
        steps[-1][rank] = ([int(v) for v in m.group(1).split("|")], m.group(2), m.group(3) and int(m.group(3)))
    assert len(steps) == 1 + 2 * (n - 1) and all(len(s) == n for s in steps), res.output
    assert [steps[0][r][0] for r in range(n)] == [[(c + 1) * 10**r for c in range(n)] for r in range(n)]
    for k in range(1, len(steps)):
        for r in range(n):
            held, (now, verb, c) = steps[k - 1][r][0], steps[k][r]
            arrived = steps[k - 1][(r - 1) % n][0][c]  # what the left neighbour held in that chunk
            assert verb == ("added" if k < n else "copied"), steps[k]  # N-1 reduce-scatter steps, then all-gather
            assert now[c] == (held[c] + arrived if verb == "added" else arrived), (r, steps[k - 1], steps[k])
            assert [v for i, v in enumerate(now) if i != c] == [v for i, v in enumerate(held) if i != c]
    total = [(c + 1) * int("1" * n) for c in range(n)]  # [111, 222, 333]
    assert [steps[-1][r][0] for r in range(n)] == [total] * n, res.output
    assert f"every rank holds [{' | '.join(map(str, total))}] == dist.all_reduce" in res.output


def test_blocking_ring_shift_deadlocks_and_ends_in_one_line():
    """01 --blocking: every rank in send(), none in recv(). It must end at the group's timeout, not hang: one
    error line from rank 0 that says why, a non-zero exit, and no traceback from the script."""
    res = launch.torchrun("01_send_recv.py", 3, ["--blocking", "--timeout-s", "2"], timeout=90)
    assert not res.timed_out and res.returncode != 0, res.output
    errors = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "deadlock" in errors[0] and "blocking send()" in errors[0], res.output
    assert "batch_isend_irecv" in errors[0] and "2 s" in errors[0], errors
    assert "ring shift: got" not in res.output and not res.ok_line(), res.output
    assert '01_send_recv.py", line' not in res.output, res.output  # torchrun's agent adds a traceback of its own


def test_no_set_epoch_replays_one_order_and_says_why():
    """04 --no-set-epoch: three epochs, the same order on each rank every epoch, then one error line."""
    res = launch.torchrun("04_sampler.py", 2, ["--no-set-epoch"], timeout=120)
    assert not res.timed_out and res.returncode != 0 and not res.ok_line(), res.output
    for r in range(2):
        orders = [text.split(": ", 1)[1] for rank, text in per_rank_lines(res.output, 2)
                  if rank == r and re.match(r"epoch \d:", text)]
        assert len(orders) == 3 and len(set(orders)) == 1, res.output
    errors = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "set_epoch(epoch)" in errors[0] and "replayed" in errors[0], res.output


def test_break_it_and_trace_flags_are_checked_before_any_group(script, monkeypatch):
    """--blocking waits 10 s for the deadlock unless told otherwise; --trace refuses more ranks than it can show."""
    monkeypatch.setattr("sys.argv", ["01_send_recv.py", "--blocking"])
    assert script("01_send_recv.py").parse_args().timeout_s == 10
    monkeypatch.setattr("sys.argv", ["01_send_recv.py", "--blocking", "--timeout-s", "3"])
    assert script("01_send_recv.py").parse_args().timeout_s == 3
    monkeypatch.setattr("sys.argv", ["01_send_recv.py"])
    assert script("01_send_recv.py").parse_args().timeout_s == 120
    monkeypatch.setenv("WORLD_SIZE", "9")
    monkeypatch.setattr("sys.argv", ["03_all_reduce.py", "--trace"])
    lesson = script("03_all_reduce.py")
    with pytest.raises(lesson.UsageError, match="--trace prints every step of every rank: run it on 2 to 8 ranks"):
        lesson.parse_args()
