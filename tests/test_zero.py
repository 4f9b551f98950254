"""07: the script end to end (gloo) and its flags. ZeroDDP against PyTorch's DDP + AdamW and its
ZeroRedundancyOptimizer (tests/workers/zero_worker.py) runs in test_fsdp.py's 3-rank launch."""

import pytest
import torch

import launch
from conftest import load_script

SCRIPT = "07_zero.py"
# Small: a 0.93M-parameter GPT-2 whose optimizer state (7 MiB) still shows next to its activations.
TINY = ["--n-layer", "2", "--n-embd", "128", "--seq-len", "64", "--steps", "2", "--bucket-cap-mb", "0.25"]


@pytest.mark.parametrize("argv, says", [
    (["--stage", "3"], "invalid choice: 3"),
    (["--lrr", "0.1"], "unrecognized arguments: --lrr"),
    (["--n-embd", "100"], "multiple of 64"),
    (["--steps", "0"], "must be >= 1"),
    (["--bucket-cap-mb", "0"], "must be >= 0.001"),
    (["--seed", str(2**32)], "must be >= 0 and < 4294967296"),
])
def test_bad_flags_are_one_usage_error(argv, says):
    script = load_script(SCRIPT)
    with pytest.raises(script.UsageError, match=says):
        script.parse_args(argv)


def table(output):
    """{(rank, what): [DDP, ZeRO-1, ZeRO-2] in MiB} from the script's markdown table."""
    rows = {}
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].isdigit():
            rows[int(cells[0]), cells[1]] = [float(c.split()[0]) for c in cells[2:]]
    return rows


@pytest.mark.slow
def test_script_end_to_end():
    res = launch.torchrun(SCRIPT, 2, TINY, timeout=240)
    assert not res.timed_out and res.returncode == 0, res.output
    ok = res.ok_line()
    assert ok and "ZeRO-1 and ZeRO-2 on 2 rank(s): weights bit-identical to DDP + AdamW's" in ok, res.output
    rows = table(res.output)
    for rank in (0, 1):
        params, grads, state, peak, sent = (rows[rank, what] for what in (
            "parameters", "gradients", "optimizer state", "peak memory", "sent per step"))
        assert params[0] == pytest.approx(params[1], abs=0.01) == pytest.approx(params[2], abs=0.01)
        # Held: stage 2 halves the gradients; both stages halve the optimizer state (up to padding and step counts).
        assert grads[1] == pytest.approx(grads[0], abs=0.01) and grads[2] == pytest.approx(grads[0] / 2, abs=0.01)
        assert state[1] == pytest.approx(state[0] / 2, abs=0.02) and state[2] == pytest.approx(state[0] / 2, abs=0.02)
        # Peak memory falls by at least most of what each stage stops holding (DDP also keeps its own buckets).
        assert peak[0] - peak[1] > 0.8 * (state[0] - state[1]), peak
        assert peak[1] - peak[2] > 0.5 * (grads[1] - grads[2]), peak
        assert sent[1] == pytest.approx(1.5 * sent[0], rel=0.01) and sent[2] == pytest.approx(sent[0], rel=0.01)


def test_zero2_peak_below_zero1_on_every_shape():
    """Few large layers (buckets of 25 MiB and more) and many small ones: ZeRO-2 keeps most of its saving (issue
    #33: on few large layers it used to peak above ZeRO-1, its full-size transients outweighing the shards)."""
    res = launch.run(launch.torchrun_cmd("tests/workers/zero_memory_worker.py", 2), timeout=180)
    assert not res.timed_out and res.returncode == 0 and res.ok_line(), res.output


def test_each_rank_and_step_trains_on_its_own_tokens(monkeypatch):
    """07's batches, as ranks 0 and 1 draw them at steps 0 and 1: four different batches (a seed without the rank
    would train every replica on the same data)."""
    zero = load_script(SCRIPT)
    args = zero.parse_args(TINY)
    drawn = []
    for rank in (0, 1):
        monkeypatch.setattr(zero, "RANK", rank)
        drawn += [zero.tokens(step, args, torch.device("cpu")) for step in (0, 1)]
    assert all(not torch.equal(a, b) for i, a in enumerate(drawn) for b in drawn[i + 1:])
