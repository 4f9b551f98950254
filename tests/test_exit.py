"""A job that keeps the wrapper alive until the interpreter exits must exit cleanly (issue #23: SIGABRT at exit)."""

import pytest

import launch


# manual: ManualDDP is the core's buckets plus a pause registered at exit, so "core" (without that pause) covers it.
@pytest.mark.parametrize("kind", ["core", "zero", "torch-via-run"])
def test_a_wrapper_alive_at_exit_does_not_abort(kind):
    # Forced (see the worker): before the fix, 10 launches of 10 aborted, for PyTorch's own DDP too (an upstream
    # race in gloo's Work teardown): the scripts' run() gives gloo's threads a moment after destroy_process_group.
    res = launch.run(launch.torchrun_cmd("tests/workers/exit_worker.py", 2, [kind]), timeout=120,
                     env=launch.make_env(FORCE_IDLE="1"))
    assert not res.timed_out and res.returncode == 0 and res.ok_line(), res.output
    assert "terminate called" not in res.output, res.output
