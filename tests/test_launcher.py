"""launch_multinode.sh: its output, its errors, and its printed commands really running on 2 loopback nodes."""

import shlex
import subprocess
import sys

import pytest

import launch

SH = str(launch.REPO / "launch_multinode.sh")


def sh(*args):
    return subprocess.run([SH, *map(str, args)], cwd=launch.REPO, capture_output=True, text=True, timeout=30)


def test_no_arguments_prints_usage_and_example():
    res = sh()
    assert res.returncode == 0 and "usage:" in res.stdout and "example:" in res.stdout


@pytest.mark.parametrize("args,message", [
    (["--nodes", "0", "--nproc-per-node", "1", "--master-addr", "h"], "--nodes must be an integer from 1 to 999999"),
    (["--nodes", "2", "--nproc-per-node", "1"], "--master-addr is required"),
    (["--nodes", "2", "--nproc-per-node", "1", "--master-addr", "h", "--script", "no.py"], "'no.py' does not exist"),
    (["--nodes", "2", "--nproc-per-node", "x", "--master-addr", "h"], "--nproc-per-node must be an integer from 1"),
    (["--bogus"], "unknown argument '--bogus'"),
    (["--nodes", "99999999999999999999", "--nproc-per-node", "1", "--master-addr", "h"], "from 1 to 999999"),
    (["--nodes", "2", "--nproc-per-node", "1", "--master-addr", "h; rm -rf /"], "a host name or an IP address"),
    (["--nodes", "2", "--nproc-per-node", "1", "--master-addr", "$(reboot)"], "a host name or an IP address"),
    (["--nodes", "2", "--nproc-per-node", "1", "--master-addr", "h", "--master-port", "0"], "from 1 to 65535"),
])
def test_bad_arguments(args, message):
    res = sh(*args)
    assert res.returncode != 0 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and message in res.stderr, res.stderr


@pytest.mark.parametrize("nodes,nproc,port", [("010", "08", "029500"), ("8", "2", "99")])
def test_numbers_are_decimal(nodes, nproc, port):
    out = sh("--nodes", nodes, "--nproc-per-node", nproc, "--master-addr", "h", "--master-port", port).stdout
    static = [shlex.split(ln) for ln in out.splitlines() if ln.startswith("torchrun") and "--node_rank" in ln]
    assert len(static) == int(nodes, 10) and all(f"--nnodes={int(nodes, 10)}" in cmd for cmd in static), out
    assert all(f"--nproc_per_node={int(nproc, 10)}" in c and f"--master_port={int(port, 10)}" in c for c in static)


def test_ipv6_master_address_is_bracketed_in_the_endpoint():
    out = sh("--nodes", "2", "--nproc-per-node", "1", "--master-addr", "fe80::1").stdout
    elastic = next(shlex.split(ln) for ln in out.splitlines() if "--rdzv-endpoint" in ln and ln.startswith("torch"))
    assert "--rdzv-endpoint=[fe80::1]:29500" in elastic, elastic


def test_prints_every_form():
    out = sh("--nodes", "3", "--nproc-per-node", "8", "--master-addr", "10.1.2.3", "--master-port", "1234",
             "--", "--out", "my dir").stdout
    static = [ln for ln in out.splitlines() if ln.startswith("torchrun") and "--node_rank" in ln]
    assert [shlex.split(ln)[2] for ln in static] == ["--node_rank=0", "--node_rank=1", "--node_rank=2"]
    assert all("--master_addr=10.1.2.3 --master_port=1234 05_manual_ddp_gpt2.py --out my\\ dir" in ln for ln in static)
    assert "--rdzv-backend=c10d --rdzv-endpoint=10.1.2.3:1234" in out
    assert "#SBATCH --nodes=3" in out and "srun torchrun" in out
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_DEBUG",
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
        assert f"export {var}=" in out


def loopback(form):
    """The printed commands of `form` run as two nodes of one process each on this machine: (their exit codes and
    outputs), or None if they hung."""
    out = sh("--nodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
             launch.free_port(), "--script", "02_broadcast.py", "--", "--src", "1", "--device", "cpu").stdout
    lines = [ln for ln in out.splitlines() if ln.startswith("torchrun")]
    cmds = lines[:2] if form == "static" else [lines[2]] * 2  # c10d: the same line on both "nodes"
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *shlex.split(c)[1:]], cwd=launch.REPO,
                              env=launch.make_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for c in cmds]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                launch.kill_tree(q)
            return None
    return [p.returncode for p in procs], outs


@pytest.fixture(scope="module")
def nodes(request):
    """Both forms' two nodes at once (each form's own port): a job of two nodes mostly starts up and waits."""
    forms = ["static", "c10d"]
    with launch.ahead(request, {f"test_printed_commands_run_on_two_loopback_nodes[{form}]": lambda form=form:
                                loopback(form) for form in forms}) as futures:
        yield futures


@pytest.mark.slow
@pytest.mark.parametrize("form", ["static", "c10d"])
def test_printed_commands_run_on_two_loopback_nodes(form, nodes, request):
    ran = nodes[request.node.name].result()
    assert ran is not None, "the printed commands hung"
    codes, outs = ran
    assert codes == [0, 0], outs
    both = "\n".join(outs)
    assert "OK dist.broadcast" in both and "[rank 0/2]" in both and "[rank 1/2]" in both, both
