"""01-04 on 3 ranks, where a wrong neighbour shows: each lesson checks itself, and what it prints equals what
the library says (torch's sampler, the ring's rule, dist.all_reduce); the hand-written pieces equal the library's;
the break-it flags show the failure they promise and end on the lesson's own line."""

import json
import math
import re

import pytest
import torch.utils.data

import launch

N = 3  # ranks: left and right neighbours differ, chunks differ in size, the tree has a short round
RUNS = [["01_send_recv.py"], ["02_broadcast.py", "--src", "2", "--numel", "1000"], ["03_all_reduce.py", "--trace"],
        ["04_sampler.py"], ["04_sampler.py", "--no-set-epoch", "--dataset-size", "7", "--seed", "5"]]


def lessons_job():
    """All RUNS in one job of N ranks (tests/workers/lessons_worker.py: receives land at wait())."""
    return launch.torchrun("tests/workers/lessons_worker.py", N, [json.dumps(RUNS)], timeout=240, device=None)


def blocking_job():
    return launch.torchrun("01_send_recv.py", N, ["--blocking", "--timeout-s", "2"], timeout=120,
                          fork=False)  # forked ranks left waiting in send() never exit; their own processes do


@pytest.fixture(scope="module")
def jobs(request):
    """The launches that this session's tests need, both at once: the deadlock mostly waits while the lessons
    work. {"lessons" or "blocking": Future}."""
    from concurrent.futures import ThreadPoolExecutor
    items = [item for item in request.session.items if item.module is request.module]
    needed = {"lessons": any("lessons" in item.fixturenames for item in items),
              "blocking": any(item.name.startswith("test_blocking") for item in items)}
    pool = ThreadPoolExecutor(2)
    try:
        yield {name: pool.submit(job) for name, job in (("lessons", lessons_job), ("blocking", blocking_job))
               if needed[name]}
    finally:
        pool.shutdown(cancel_futures=True)


@pytest.fixture(scope="module")
def lessons(jobs):
    """{script and flags: [each rank's output]}, from the one job."""
    res = jobs["lessons"].result()
    assert not res.timed_out and res.returncode == 0, res.output
    runs = [json.loads(ln[4:]) for ln in res.output.splitlines() if ln.startswith("RUN ")]
    return {" ".join(run["argv"]): run["outputs"] for run in runs}


def tagged(output):
    """(rank, text) of every line tagged "[rank r/N]", in the order printed."""
    found = [re.match(rf"\[rank (\d+)/{N}\] (.*)", ln) for ln in output.splitlines()]
    return [(int(m.group(1)), m.group(2)) for m in found if m]


def test_lessons_check_themselves_on_3_ranks(lessons):
    """Every run ends on rank 0's OK line, which only the script's own checks let it print."""
    assert sorted(lessons) == sorted(" ".join(argv) for argv in RUNS), list(lessons)
    for name, outputs in lessons.items():
        assert outputs[0].splitlines()[-1].startswith("OK "), (name, outputs[0])
        assert not any("OK " in out for out in outputs[1:]), (name, outputs)


def test_01_every_rank_joins_and_gets_its_left_neighbours_tensor(lessons):
    outputs = lessons["01_send_recv.py"]
    lines = [(r, text) for out in outputs for r, text in tagged(out)]
    assert all(r == rank for rank, out in enumerate(outputs) for r, _ in tagged(out)), outputs  # own tag
    rows = {r: dict(kv.split("=", 1) for kv in text.split()) for r, text in lines if text.startswith("RANK=")}
    assert {r: (row["RANK"], row["LOCAL_RANK"], row["WORLD_SIZE"], row["GROUP_RANK"]) for r, row in rows.items()} \
        == {r: (str(r), str(r), str(N), "0") for r in range(N)}, rows
    got = {r: text for r, text in lines if text.startswith("send/recv: got")}
    assert got == {r: f"send/recv: got {[float(r)] * 4} from rank 0" for r in range(1, N)}, got
    shift = {r: text for r, text in lines if text.startswith("ring shift: got")}
    assert shift == {r: f"ring shift: got {(r - 1) % N} from rank {(r - 1) % N}" for r in range(N)}, shift
    story = outputs[0]
    assert f"isend/irecv gather: {[[10.0 * r, 10.0 * r + 1] for r in range(N)]} == dist.gather" in story, story
    assert f"token ring: came back as {sum(range(N))} = " in story, story


def test_02_broadcasts_from_src_and_makes_replicas_from_rank_0(lessons):
    story = lessons["02_broadcast.py --src 2 --numel 1000"][0]
    lines = tagged(story)
    before = [text.split(": ", 1)[1] for _, text in lines if text.startswith("before dist.broadcast")]
    after = [text.split(": ", 1)[1] for _, text in lines if text.startswith("after  dist.broadcast")]
    assert [r for r, _ in lines] == list(range(N)) * 2, story  # in rank order
    assert len(set(before)) == N and after == [before[2]] * N, story
    assert f"in ceil(log2 {N}) = {math.ceil(math.log2(N))} round(s)" in story, story
    assert "after:  replicas identical, with rank 0's parameters" in story, story


def test_03_trace_follows_the_rings_rule_and_adds_what_the_left_neighbour_held(lessons):
    """Each step's line names the chunks and neighbours of the ring's rule (reduce-scatter step s: rank r sends
    chunk r-s to r+1 and adds chunk r-s-1 from r-1; all-gather: sends r+1-s, copies r-s); the value that arrived
    is what the rank it names held in that chunk the step before; every rank ends with dist.all_reduce's sum."""
    story = lessons["03_all_reduce.py --trace"][0]
    line = re.compile(r"holds \[([^]]*)\](?:  sent chunk (\d) to rank (\d), (added|copied) chunk (\d) "
                      r"from rank (\d))?$")
    steps = []  # per step: {rank: (holdings, sent, to, verb, received, from)}
    for rank, text in tagged(story):
        m = line.match(text)
        assert m, text
        if rank == 0:
            steps.append({})
        holds, *rest = m.groups()
        steps[-1][rank] = ([int(v) for v in holds.split("|")], *[v if v in (None, "added", "copied") else int(v)
                                                                   for v in rest])
    assert len(steps) == 1 + 2 * (N - 1) and all(sorted(s) == list(range(N)) for s in steps), story
    assert [steps[0][r][0] for r in range(N)] == [[(c + 1) * 10**r for c in range(N)] for r in range(N)], story
    for k in range(1, len(steps)):
        s, phase = (k - 1, "added") if k < N else (k - N, "copied")
        for r in range(N):
            held, (now, sent, to, verb, c, frm) = steps[k - 1][r][0], steps[k][r]
            rule = ((r - s) % N, (r - s - 1) % N) if phase == "added" else ((r + 1 - s) % N, (r - s) % N)
            assert (verb, sent, c, to, frm) == (phase, *rule, (r + 1) % N, (r - 1) % N), (k, r, steps[k][r])
            arrived = steps[k - 1][frm][0][c]  # what the rank it names held in that chunk
            assert now[c] == (held[c] + arrived if verb == "added" else arrived), (k, r, steps[k - 1], steps[k])
            assert [v for i, v in enumerate(now) if i != c] == [v for i, v in enumerate(held) if i != c]
    total = [(c + 1) * int("1" * N) for c in range(N)]  # [111, 222, 333]
    assert [steps[-1][r][0] for r in range(N)] == [total] * N, story
    assert f"every rank holds [{' | '.join(map(str, total))}] == dist.all_reduce" in story, story


def torch_orders(size, seed, epoch, drop_last=False):
    """Each rank's indices in that epoch, from torch's own DistributedSampler."""
    samplers = [torch.utils.data.DistributedSampler(range(size), num_replicas=N, rank=r, seed=seed,
                                                    drop_last=drop_last) for r in range(N)]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    return [list(sampler) for sampler in samplers]


@pytest.mark.parametrize("run,size,seed,set_epoch", [("04_sampler.py", 11, 0, True),
                                                     ("04_sampler.py --no-set-epoch --dataset-size 7 --seed 5", 7,
                                                      5, False)])
def test_04_orders_padding_and_accuracy_equal_torchs_sampler(lessons, run, size, seed, set_epoch):
    """What each rank prints is torch's DistributedSampler's order, epoch by epoch (epoch 0 again and again
    without set_epoch); the repeats, the dropped samples and the accuracies follow from torch's indices."""
    story = lessons[run][0]
    lines = tagged(story)
    first = [text for _, text in lines if text.startswith("epoch 0 indices")]
    assert first == [f"epoch 0 indices: {order}  (== torch's)" for order in torch_orders(size, seed, 0)], story
    for epoch in range(3):
        shown = [(r, text) for r, text in lines if text.startswith(f"epoch {epoch}: ")]
        want = torch_orders(size, seed, epoch if set_epoch else 0)
        assert shown == [(r, f"epoch {epoch}: {want[r]}") for r in range(N)], (epoch, story)
    padded = sum(torch_orders(size, seed, 0), [])
    twice = sorted({i for i in padded if padded.count(i) > 1})
    assert f"padding: {len(padded)} slots for {size} samples -> seen twice: {twice}" in story, story
    used = set(sum(torch_orders(size, seed, 0, drop_last=True), []))
    assert f"{len(used)} samples used, never seen this epoch: {sorted(set(range(size)) - used)}" in story, story
    if not set_epoch:  # the break-it run stops after showing the repeat, and says how to fix it
        assert "accuracy" not in story and "sampler.set_epoch(epoch) before each epoch" in story, story
        return
    in_order = list(range(size)) + list(range(-size % N))  # shuffle=False pads with the first ones
    assert f"evaluation in order: seen twice: {sorted(set(range(-size % N)))}" in story, story
    naive = sum(i % 3 != 0 for i in in_order) / len(in_order)
    exact = sum(i % 3 != 0 for i in range(size)) / size
    assert (f"accuracy: exact {exact:.4f} | naive distributed {naive:.4f} over {len(in_order)} samples | "
            f"padding masked {exact:.4f} over {size} samples") in story, story


def test_blocking_ring_shift_deadlocks_and_the_lesson_has_the_last_word(jobs):
    """01 --blocking: every rank in send(), none in recv(). The group's timeout ends it, never a hang. Then the
    lesson says what happened and exits 0, so its own line is the last the reader sees (no failure summary)."""
    res = jobs["blocking"].result()
    assert not res.timed_out and res.returncode == 0, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip() and not ln.startswith("[launch]")]
    assert lines[-2].startswith("deadlock: every rank waited in send()") and "2 s timeout" in lines[-2], lines
    assert lines[-1].startswith("OK --blocking deadlocked") and "batch_isend_irecv" in lines[-1], lines
    assert "ring shift: got" not in res.output and "Traceback" not in res.output, res.output


@pytest.mark.parametrize("nproc", [2, pytest.param(3, marks=pytest.mark.slow)])  # 3 ranks on 2 cores: 12 s
def test_ring_all_reduce_matches_library(nproc):
    """Both of 03's rings graded as a participant's is (3 ranks: chunks of unequal size, sums of three terms whose
    order matters), and the pipelined one in pieces of one element up: the lesson's ring, bit for bit."""
    res = launch.torchrun("tests/workers/ring_worker.py", nproc, timeout=240, device=None)
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
    with pytest.raises(lesson.UsageError, match="--trace prints every step of every rank, so run it on 2 to 8 ranks"):
        lesson.parse_args()
