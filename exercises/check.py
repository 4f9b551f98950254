"""Grade an exercise. It says the first thing wrong, or OK.

  python exercises/check.py ring_all_reduce                 grades exercises/ring_all_reduce.py
  python exercises/check.py ring_all_reduce --file mine.py  grades another file
  python exercises/check.py ring_all_reduce --solution      grades the project's own code

The names follow the ladder in exercises/README.md. The checker starts the ranks itself, as
processes on this machine with gloo on the CPU. It needs no torchrun. It grades with the same checks
that the project's tests run on the project's own code. A rank may wait --hang-s seconds in one
call. After that, the run ends with one line that says where each rank waited. The exit status is 0
only when every file passes.
"""

import argparse
import glob
import json
import multiprocessing
import os
import socket
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
GRACE_S = 3  # once a rank is done or stuck, the others get this long to finish or say where


# --- grading one file: start the ranks, watch them, read what each says ---
def grade(name: str, path: str, world: int, hang_s: float, speed: bool,
          shown: str | None = None) -> dict:
    """Run the file at `path` as exercise `name` on `world` ranks. Return the verdict, a dict.

    `shown` is the path as the user gave it."""
    # Fork on Linux, so torch is imported once, here, and each rank starts at once. macOS spawns.
    ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    with tempfile.TemporaryDirectory(prefix="check-") as tmp:
        port = free_port()
        procs = [ctx.Process(target=rank_main,
                             args=(name, path, r, world, port, hang_s, speed, tmp))
                 for r in range(world)]
        try:
            for p in procs:
                p.start()
            watch(procs, tmp, hang_s)
        finally:
            for p in procs:  # kill all first, or a rank left alive reports its peers' deaths
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join()
        records = [read_json(os.path.join(tmp, f"rank{r}.json")) for r in range(world)]
        hangs = [read_json(os.path.join(tmp, f"rank{r}.hang.json")) for r in range(world)]
        outputs = [read_text(os.path.join(tmp, f"rank{r}.out")) for r in range(world)]
    return verdict(name, path, records, hangs, outputs, [p.exitcode for p in procs], hang_s, shown)


def watch(procs, tmp, hang_s):
    """Wait for the ranks, and return when they are done or stuck. The caller kills the rest.

    A rank may report a hang, or some ranks may be done while others still run after GRACE_S. Then
    every rank's watchdog is asked where it waits, and gets GRACE_S to say so."""
    request, since_done, asked = os.path.join(tmp, "dump"), None, None
    backstop = time.monotonic() + 120 + 20 * hang_s  # in case the watchdogs themselves are stuck
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        if asked is not None:
            dumped = [os.path.exists(os.path.join(tmp, f"rank{r}.hang.json"))
                      for r in range(len(procs))]
            if now - asked > GRACE_S or all(d or not p.is_alive() for d, p in zip(dumped, procs)):
                return
        elif glob.glob(os.path.join(tmp, "rank*.hang.json")) or now > backstop or (
                since_done is not None and now - since_done > GRACE_S):
            open(request, "w").close()
            asked = now
        elif since_done is None and any(not p.is_alive() for p in procs):
            since_done = now
        time.sleep(0.05)


def rank_main(name, path, rank, world, port, hang_s, speed, tmp):
    """One rank, in its own process. It grades the file and writes its output and record."""
    out = open(os.path.join(tmp, f"rank{rank}.out"), "w")
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    # Loopback only. Nothing leaves the machine, and it needs no route or host name.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    sys.path.insert(0, HERE)
    import grading
    import harness
    import torch
    torch.set_num_threads(1)  # N ranks share this machine's cores
    harness.start_watchdog(hang_s, os.path.join(tmp, f"rank{rank}.hang.json"),
                           os.path.join(tmp, "dump"), path)
    record = harness.run_rank(grading.EXERCISES[name], path, rank, world, hang_s, speed)
    with open(os.path.join(tmp, f"rank{rank}.json.tmp"), "w") as f:
        json.dump(record, f)
    os.replace(os.path.join(tmp, f"rank{rank}.json.tmp"), os.path.join(tmp, f"rank{rank}.json"))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown, since gloo's threads may still hold a peer that is gone


# --- what the ranks said, in words ---
def verdict(name: str, path: str, records: list, hangs: list, outputs: list[str], exitcodes: list,
            hang_s: float, shown: str | None = None) -> dict:
    """Turn the ranks' records into one verdict, {"file", "status", "text", "outputs"}.

    The status is ok, fail, not_implemented, error, hang or crash. The text is what gets printed."""
    shown = shown or os.path.relpath(path)
    found = [r for r in records if r]
    stub = next((r for r in found if r["status"] == "not_implemented"), None)
    errors = sorted((r["time"], k, r) for k, r in enumerate(records)
                    if r and r["status"] == "error")
    # A rank that lost its peer fails too ("Connection reset by peer"). The peer's own error, or its
    # hang, is the story. A peer that gloo aborted left no record, only its last words.
    first = [e for e in errors if not lost_peer(e[2]["message"])]
    aborted = next(((k, line) for k, (r, text) in enumerate(zip(records, outputs)) if not r
                    for line in text.splitlines()
                    if any(cause in line for cause, _ in ABORTS)), None)
    fails = [r for r in found if r["status"] == "fail"]
    if stub:
        where, default = stub["where"], os.path.join(HERE, f"{name}.py")
        command = f"python exercises/check.py {name}"
        command += "" if path == default else f" --file {shown}"
        status, text = "not_implemented", (
            f"NOT IMPLEMENTED {shown}: {stub['name'] or where['function']} still raises "
            f"NotImplementedError (line {where['line']}, in {where['function']}). Open {shown}, "
            f"read its docstring and hints, and write it. Then run `{command}` again.")
    elif aborted and not first:
        k, line = aborted
        label = next((e[2].get("label") for e in errors if e[2].get("label")), None)
        status, text = "error", (f"ERROR {shown}: rank {k} was aborted by gloo"
                                 + (f" during {label}" if label else "") + f": {line.strip()}"
                                 + f"\n  hint: {next(h for cause, h in ABORTS if cause in line)}")
    elif first or (errors and not any(hangs)):
        _, k, r = (first or errors)[0]
        status, text = "error", f"ERROR {shown}: rank {k} raised {r['message']}{located(r)}" + (
            f" (during {r['label']})" if r.get("label") else "") + error_hint(r["message"])
    elif any(hangs):
        status, text = "hang", hang_line(shown, records, hangs, hang_s, name)
    elif fails:
        status, text = "fail", f"FAIL {shown}: {fails[0]['message']}"
    elif len(found) == len(records) and all(r["status"] == "pass" for r in found):
        status, text = "ok", f"OK {name}: {shown} passes\n" + "\n".join(f"  {line}"
                                                                       for line in found[0]["info"])
    else:
        k = next(k for k, r in enumerate(records) if not r)
        status, text = "crash", (f"CRASH {shown}: rank {k} ended without a verdict (exit code "
                                 f"{exitcodes[k]}). Its last output is above")
    return {"file": path, "status": status, "text": text, "outputs": outputs}


def located(record):
    w = record.get("where") or record.get("checker")
    if not w:
        return ""
    code = f": `{w['code']}`" if w.get("code") else ""
    function = f" in {w['function']}" if w.get("function") else ""
    return f" at {w['file']}:{w['line']}{function}{code}"


ERROR_HINTS = [  # (text in the error, the usual cause)
    ("view size is not compatible", "a tensor that is not contiguous, such as a transposed one, "
     "has no flat view. Work on tensor.contiguous(), or on .reshape(-1), which may copy. Then copy "
     "the result back into tensor"),
    ("Tensors must be contiguous", "gloo sends contiguous memory only. Send a contiguous copy, or "
     "a slice of a flat, contiguous tensor"),
    ("Timed out", "a rank waited for a message that never came. Check that every send has a "
     "matching receive"),
]


LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
ABORTS = [  # (what gloo prints as it aborts a process, the usual cause)
    ("Received data size doesn't match expected size", "the ranks' messages differ in size. The "
     "receiving rank expected fewer bytes than its peer sent. Perhaps a receive buffer has the "
     "size of another chunk. Or the ranks issued their collectives in different orders, so that "
     "different tensors met"),
]


def lost_peer(message):
    """Whether an error only says that a peer went away. Then the peer's own error is the cause."""
    return any(text in message for text in LOST_PEER)


def error_hint(message):
    hint = next((h for text, h in ERROR_HINTS if text in message), None)
    return f"\n  hint: {hint}" if hint else ""


def hang_line(shown, records, hangs, hang_s, name=None):
    """One line that says where each rank waited, and for what, such as the peer of a send.

    It adds whether the pairs match, and then a hint for the usual cause."""
    label = next((h["label"] for h in hangs if h and h.get("label")), None)
    places = []
    for k, (h, r) in enumerate(zip(hangs, records)):
        if h and h.get("where"):
            call = f", {h['call']['text']}" if h.get("call") else ""
            places.append(f"rank {k} waits at {place(h['where'])}{call}")
        elif h and h.get("checker"):
            places.append(f"rank {k} returned from your code and waits for the others in the "
                          "checker")
        elif r:
            places.append(f"rank {k} had finished ({r['status']})")
        else:
            places.append(f"rank {k} said nothing (killed)")
    line = (f"HANG {shown}: no progress for {hang_s:g} s" + (f" in {label}" if label else "") + ": "
            + "; ".join(places))
    said, hint = diagnosis(hangs, name)
    if said:
        line += ". " + said
    if len(hangs) == 1:  # one process, so no peer to wait for
        where = hangs[0].get("where") if hangs[0] else None
        line = (f"HANG {shown}: no progress for {hang_s:g} s" + (f" in {label}" if label else "")
                + (f": still running at {place(where)}" if where else ""))
    return (f"{line}\n  hint: {hint}. Only slow, not stuck? Then give each call more time with "
            "--hang-s")


def diagnosis(hangs: list, name: str | None = None) -> tuple[str, str]:
    """What the ranks' waits say together, and the usual cause: (a sentence, a hint).

    The sentence is "" when the waits say nothing more. `hangs` holds, per rank, where it waited
    (harness.hang_record) or None. A notebook's "Your turn" check says the same, through
    notebooks/ranks.py."""
    calls = {k: h["call"] for k, h in enumerate(hangs) if h and h.get("where") and h.get("call")}
    unmatched = mismatched_pairs(calls, hangs)
    differ = differing_collectives(hangs)
    said = ""
    if unmatched:
        said = "The pairs do not match: " + "; ".join(unmatched)
    elif differ:
        said = differ
    elif len(calls) > 1 and all(c["kind"] == "send" for c in calls.values()):
        said = "Every rank waits in a send and none in a receive, so no message can be taken"
    codes = [h["where"]["code"] for h in hangs if h and h.get("where")]
    if len(hangs) == 1:
        hint = "a loop that never ends? Check its exit condition"
    elif name == "tree_broadcast" and unmatched:
        hint = ("in round k, with step = 2**k, vrank v < step sends to v + step. A vrank v with "
                "step <= v < 2 * step receives from v - step. So each sender's partner receives "
                "from it in the same round. Compute both partners the same way, and turn a vrank "
                "back into a rank with (vrank + src) % N on both sides")
    elif unmatched:
        hint = ("every send needs a receive that its peer posts for it, with the same size. Check "
                "how each rank computes its partner")
    elif differ:
        hint = ("every rank must issue the same collectives in the same order. That means the same "
                "buckets, in bucket order, whatever order its gradients arrive in")
    elif any("send(" in c and "isend(" not in c for c in codes):
        hint = ("dist.send blocks until the receiving rank has posted its receive. When every rank "
                "sends first, as in a ring, nobody receives. Post the receive with dist.irecv, or "
                "send with dist.isend, and then wait for both")
    elif any(h and not h.get("where") and h.get("checker") for h in hangs):
        hint = ("some ranks left your function while others still wait for a message. So the "
                "ranks sent and received different numbers of messages. Every send needs a receive "
                "on its peer, with the same size")
    else:
        hint = ("the ranks wait for messages that never come. Every send needs a receive on its "
                "peer, and every rank must call the same collectives in the same order")
    return said, hint


def mismatched_pairs(calls, hangs):
    """A line for each rank whose send or receive has no matching call on its peer.

    For example: 'rank 1 sends to rank 2, but rank 2 receives from rank 0'."""
    out = []
    if all(c["kind"] == "send" for c in calls.values()):
        return out  # every rank sends first and nobody receives: the send hint says so
    for k, c in sorted(calls.items()):
        peer = c.get("peer")
        if c["kind"] not in ("send", "recv") or peer is None:
            continue
        other = calls.get(peer)
        verb = "sends to" if c["kind"] == "send" else "receives from"
        want = "recv" if c["kind"] == "send" else "send"
        if other and other["kind"] == want and other.get("peer") in (k, None):
            continue  # a matching pair, blocked for another reason (both sending, sizes)
        if other and other["kind"] in ("send", "recv"):
            theirs = ("sends to" if other["kind"] == "send" else "receives from") + (
                " any rank" if other.get("peer") is None else f" rank {other['peer']}")
        elif other:
            theirs = f"is in dist.{other['op']}"
        elif (peer < len(hangs) and hangs[peer] and hangs[peer].get("checker")
              and not hangs[peer].get("where")):
            theirs = "has returned from your function"
        else:
            theirs = "is not in a send or receive"
        out.append(f"rank {k} {verb} rank {peer}, but rank {peer} {theirs}")
    return out


def differing_collectives(hangs):
    """When the ranks issued different collectives before they got stuck, say so."""
    issued = {k: [tuple(c) for c in h.get("collectives") or []] for k, h in enumerate(hangs) if h}
    if len(issued) < 2 or len({tuple(v) for v in issued.values()}) == 1 or not any(issued.values()):
        return ""
    words = "; ".join(f"rank {k}: " + (", ".join(f"{op} of {n}" for op, n in v) or "none")
                      for k, v in sorted(issued.items()))
    return ("The ranks issued different collectives, in this order (" + words + " elements). A "
            "collective pairs the k-th call of every rank, so these never meet")


def place(w):
    code = f" (`{w['code']}`)" if w.get("code") else ""
    return f"{w['file']}:{w['line']} in {w['function']}" + code


def report(v: dict, tail: int = 30) -> None:
    """Print what the ranks printed (the participant's own prints), then the verdict."""
    for k, text in enumerate(v["outputs"]):
        lines = [ln for ln in text.splitlines() if ln.strip()]
        if lines and v["status"] != "ok":
            if len(lines) > tail:
                print(f"[rank {k}] ... ({len(lines) - tail} earlier lines not shown)")
            for ln in lines[-tail:]:
                print(f"[rank {k}] {ln}")
    print(v["text"], flush=True)


# --- plumbing: files, ports, arguments ---
def shorter(path):
    """The path relative to the current directory, unless that climbs out of it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def read_text(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def parse_args(argv: list[str] | None, exercises: dict) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=list(exercises), help="the exercise")
    p.add_argument("--file", action="append",
                   help="grade this file instead of exercises/NAME.py (give it more than once)")
    p.add_argument("--solution", action="store_true", help="grade the project's own implementation")
    p.add_argument("--ranks", type=int, default=None,
                   help="how many processes to start (default: the exercise's own number)")
    p.add_argument("--hang-s", type=float, default=20,
                   help="how many seconds one call may wait before it counts as a hang")
    p.add_argument("--no-speed", action="store_true",
                   help="skip the speed measurement after a pass")
    p.add_argument("--json", help="also write the verdicts to this file (for the tests)")
    a = p.parse_args(argv)
    if a.solution and a.file:
        p.error("--solution grades the project's own file, so leave out --file")
    if a.ranks is not None and exercises[a.name].ranks == 1:
        p.error(f"--ranks does not apply to {a.name}. It runs in one process and passes "
                "num_replicas and rank itself")
    if a.ranks is not None and a.ranks < 2:
        p.error("--ranks must be 2 or more")
    if not a.hang_s > 0:
        p.error("--hang-s must be more than 0")
    return a


def main(argv: list[str] | None = None) -> int:
    """Grade the files on the command line. Return 0 when all pass, 1 if not, 2 on bad input."""
    sys.path.insert(0, HERE)
    import grading  # torch: imported once here, before the ranks are forked
    args = parse_args(argv, grading.EXERCISES)
    exercise = grading.EXERCISES[args.name]
    if exercise.ranks > 1:
        # PyTorch's DDP imports it when first built. That takes 2 s, once here, not in each rank.
        import torch._dynamo  # noqa: F401
    files = args.file or [os.path.join(REPO, exercise.reference) if args.solution else
                          os.path.join(HERE, f"{args.name}.py")]
    for path in files:
        if not os.path.isfile(path):
            print(f"error: no such file: {path}", file=sys.stderr)
            return 2
    world = args.ranks or exercise.ranks
    verdicts = []
    for path in files:
        where = f"on {world} ranks, gloo on the CPU" if world > 1 else "in one process"
        shown = path if args.file else shorter(path)  # a --file shows as the user gave it
        print(f"checking {shown} ({args.name}) {where}", flush=True)
        v = grade(args.name, os.path.abspath(path), world, args.hang_s, not args.no_speed, shown)
        report(v)
        verdicts.append(v)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v[k] for k in ("file", "status", "text")} for v in verdicts], f,
                      indent=1)
    return 0 if all(v["status"] == "ok" for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
