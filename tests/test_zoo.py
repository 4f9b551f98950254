"""Models nobody designed for our wrappers (frozen layers seeded per rank, BatchNorm and other integer buffers,
bf16 and float64 layers beside float32, misaligned sizes, tied weights, unused parameters): 05, 07 and 08's
wrappers against PyTorch's DDP, DDP with ZeroRedundancyOptimizer and fully_shard, bit for bit, on 3 and 2 ranks."""

import launch


def test_model_zoo_bit_for_bit_against_pytorch_on_3_and_2_ranks():
    res = launch.torchrun_forked("tests/workers/zoo_worker.py", {3: []}, timeout=180, device=None)[3]  # one import
    assert not res.timed_out and res.returncode == 0, res.output
    assert res.ok_line() and "on 3 ranks and on 2" in res.ok_line(), res.output
