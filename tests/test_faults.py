"""When things go wrong outside the flags (issue #33): Ctrl-C and SIGTERM end a run in one line."""

import signal
import sys

import pytest

import launch


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_ends_run_in_one_line_by_that_signal(signum):
    """The setup block's run(): a signal is one line and the status a shell expects (128 + signal: 130, 143),
    with cleanup on the way out (the `finally` below) and no traceback, even when the library it landed in
    reports it as an error of its own (as torch.save does)."""
    code = ("import os, sys; sys.path.insert(0, 'tests'); from conftest import load_script\n"
            "lesson = load_script('01_send_recv.py')\n"
            "def main(args):\n"
            "    try:\n"
            f"        os.kill(os.getpid(), {int(signum)})\n"
            "        import time; time.sleep(30)\n"
            "    except BaseException:\n"
            "        raise RuntimeError('unexpected pos 704 vs 598')\n"
            "    finally:\n"
            "        print('cleaned up', flush=True)\n"
            "lesson.run(main, lambda: None)\n")
    res = launch.run([sys.executable, "-c", code], timeout=60)
    assert res.returncode == -signum, res.output
    assert res.output == f"cleaned up\ninterrupted by {signal.Signals(signum).name}\n", res.output
