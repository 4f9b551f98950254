"""launch_multinode.sh: its output, its errors, and its printed commands really running on 2 loopback nodes."""

import json
import os
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


def torchrun_args(words):
    """A printed torchrun command, read by torchrun's own parser: what torchrun will do with it."""
    from torch.distributed.run import get_args_parser
    assert words[0] == "torchrun", words
    return get_args_parser().parse_args(words[1:])


def run_sbatch(text, tmp_path, nodelist, job_id):
    """The printed SLURM batch script, run by bash as SLURM runs it on the first node, with stand-ins for scontrol
    (it lists the nodes) and srun (it records what it was asked to start). Returns srun's arguments and the
    environment that srun saw."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && echo "$3" | tr , "\\n"\n')
    (bin_dir / "srun").write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                                  "print(json.dumps([sys.argv[1:], dict(os.environ)]))\n")
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    (tmp_path / "job.sbatch").write_text(text)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST=nodelist,
               SLURM_NNODES=str(len(nodelist.split(","))), SLURM_JOB_ID=job_id)
    res = subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=env, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.parametrize("nodes,nproc,port,addr", [("3", "8", "1234", "10.1.2.3"), ("1", "1", None, "node0"),
                                                   ("010", "08", "029501", "fe80::1")])
def test_the_printed_commands_are_what_torchrun_needs_on_n_nodes(nodes, nproc, port, addr, tmp_path):
    """Every form, read by torchrun's own parser. N nodes of G processes make N*G ranks. The static lines give
    node ranks 0..N-1, one to each line, and the same address and port to all. The c10d line and the SLURM script
    name the same endpoint, nodes and processes, and SLURM's variables fill in the rest. Numbers are decimal, as
    torchrun reads them ("010" is ten), and an IPv6 endpoint takes brackets."""
    args = ["--nodes", nodes, "--nproc-per-node", nproc, "--master-addr", addr, "--script", "03_all_reduce.py"]
    res = sh(*args, *(["--master-port", port] if port else []), "--", "--trace", "my dir")
    assert res.returncode == 0, res.stderr
    n, g, p = int(nodes, 10), int(nproc, 10), int(port or "29500", 10)
    endpoint = f"[{addr}]:{p}" if ":" in addr else f"{addr}:{p}"
    lines = res.stdout.splitlines()
    assert lines[0].startswith(f"# {n} node(s) x {g} process(es) = {n * g} ranks."), lines[0]
    launched = [torchrun_args(shlex.split(ln)) for ln in lines if ln.startswith("torchrun")]
    static, elastic = launched[:-1], launched[-1]
    assert [a.node_rank for a in static] == list(range(n)), res.stdout  # line K is node K
    for a in static:
        assert (a.nnodes, a.nproc_per_node, a.master_addr, a.master_port) == (str(n), str(g), addr, p), a
        assert a.rdzv_backend == "static", a
    assert (elastic.nnodes, elastic.nproc_per_node, elastic.rdzv_backend, elastic.rdzv_endpoint) == \
        (str(n), str(g), "c10d", endpoint), elastic
    assert elastic.rdzv_id not in ("", "none"), elastic  # every node names the same job
    sbatch = res.stdout[res.stdout.index("#!/bin/bash"):]
    for line in (f"--nodes={n}", "--ntasks-per-node=1", f"--gpus-per-node={g}"):
        assert f"#SBATCH {line}\n" in sbatch, sbatch  # one task per node: its torchrun starts the G processes
    argv, seen = run_sbatch(sbatch, tmp_path, ",".join(f"node{k}" for k in range(n)), "4242")
    slurm = torchrun_args(argv)
    assert (slurm.nnodes, slurm.nproc_per_node, slurm.rdzv_backend, slurm.rdzv_endpoint, slurm.rdzv_id) == \
        (str(n), str(g), "c10d", f"node0:{p}", "4242"), argv  # the first node hosts the rendezvous
    assert (seen["MASTER_ADDR"], seen["MASTER_PORT"], seen["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"]) == \
        ("node0", str(p), "1"), argv
    for a in [*launched, slurm]:
        assert (a.training_script, a.training_script_args) == ("03_all_reduce.py", ["--trace", "my dir"]), a
    exported = [ln.split()[1].split("=")[0] for ln in lines if ln.startswith("export ")]
    assert exported[:5] == ["NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_DEBUG",
                            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"], exported


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
