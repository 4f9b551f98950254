#!/usr/bin/env bash
# Print the exact commands that run one of our scripts on several nodes. It prints them, and runs
# nothing. There are four forms: torchrun with a static rendezvous (one line per node), torchrun with
# the elastic c10d rendezvous (one line for all nodes), a SLURM batch script, and the environment
# variables that matter.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: ./launch_multinode.sh --nodes N --nproc-per-node G --master-addr HOST [--master-port P]
                             [--script FILE] [-- SCRIPT_ARGS...]

  --nodes N            number of machines (>= 1)
  --nproc-per-node G   processes per machine, usually its number of GPUs (>= 1)
  --master-addr HOST   address of node 0, reachable from every node
  --master-port P      a free TCP port on node 0 (default 29500)
  --script FILE        the training script (default 05_manual_ddp_gpt2.py)
  -- SCRIPT_ARGS       passed to the script unchanged

example:
  ./launch_multinode.sh --nodes 2 --nproc-per-node 8 --master-addr 10.0.0.1 -- --out ckpt --precision bf16
EOF
}

die() { echo "error: $*" >&2; exit 2; }

[ $# -eq 0 ] && { usage; exit 0; }

nodes="" nproc="" addr="" port=29500 script=05_manual_ddp_gpt2.py
script_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --nodes|--nproc-per-node|--master-addr|--master-port|--script)
      [ $# -ge 2 ] || die "$1 needs a value"
      case "$1" in
        --nodes) nodes=$2 ;; --nproc-per-node) nproc=$2 ;; --master-addr) addr=$2 ;;
        --master-port) port=$2 ;; --script) script=$2 ;;
      esac
      shift 2 ;;
    --) shift; script_args=("$@"); break ;;
    *) die "unknown argument '$1' (see ./launch_multinode.sh --help)" ;;
  esac
done

# Numbers are decimal, so "010" is ten. Bash would read eight, but torchrun ten, and then the nodes
# would never meet.
decimal() { [[ "$1" =~ ^[0-9]{1,6}$ ]] && echo $((10#$1)); }
nodes_n=$(decimal "$nodes") && [ "$nodes_n" -ge 1 ] || die "--nodes must be an integer from 1 to 999999, got '${nodes}'"
nproc_n=$(decimal "$nproc") && [ "$nproc_n" -ge 1 ] || \
  die "--nproc-per-node must be an integer from 1 to 999999, got '${nproc}'"
port_n=$(decimal "$port") && [ "$port_n" -ge 1 ] && [ "$port_n" -le 65535 ] || \
  die "--master-port must be an integer from 1 to 65535, got '$port'"
nodes=$nodes_n nproc=$nproc_n port=$port_n
[ -n "$addr" ] || die "--master-addr is required: the address of node 0, reachable from every node"
# Only a host name or an IP address (v4 or v6) gets through, since the lines are pasted into shells.
[[ "$addr" =~ ^[A-Za-z0-9]([A-Za-z0-9.-]{0,252}[A-Za-z0-9])?$ || "$addr" =~ ^[0-9A-Fa-f:.]{2,45}$ ]] || \
  die "--master-addr must be a host name or an IP address, got '$addr'"
[ -f "$script" ] || die "--script '$script' does not exist (run from the repository root, or give a path)"
endpoint="$addr:$port"
[[ "$addr" == *:* ]] && endpoint="[$addr]:$port"  # IPv6 in a host:port pair takes brackets

# Every printed argument is quoted, so the lines paste back into a shell as they are.
tail_args=$(printf ' %q' "$script" "${script_args[@]}")
q_addr=$(printf '%q' "$addr") q_endpoint=$(printf '%q' "$endpoint")
world=$((nodes * nproc))

echo "# $nodes node(s) x $nproc process(es) = $world ranks. Run from the repository root on every node."
echo
echo "# --- environment (on every node, before torchrun) ---"
echo "export NCCL_SOCKET_IFNAME=eth0      # the network card that reaches $addr ('ip -br addr' lists them)"
echo "export GLOO_SOCKET_IFNAME=eth0      # the same for gloo, which carries CPU runs and some control traffic"
echo "export NCCL_IB_DISABLE=0            # 1 forces TCP, when InfiniBand is missing or broken"
echo "export NCCL_DEBUG=WARN              # INFO prints NCCL's rings and transports. Read them first on a hang."
echo "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # a restarted round meets again cleanly (pytorch#135712)"
echo
echo "# --- static rendezvous: node 0 hosts it at $addr:$port; run line K on node K ---"
for ((k = 0; k < nodes; k++)); do
  echo "torchrun --nnodes=$nodes --node_rank=$k --nproc_per_node=$nproc --master_addr=$q_addr --master_port=$port$tail_args"
done
echo
echo "# --- c10d rendezvous (elastic): the same line on every node, in any order ---"
echo "# (add --max-restarts=3 to survive crashes)"
echo "torchrun --nnodes=$nodes --nproc_per_node=$nproc --rdzv-backend=c10d --rdzv-endpoint=$q_endpoint --rdzv-id=ddp-job$tail_args"
echo
echo "# --- SLURM: save this as job.sbatch, then run sbatch job.sbatch. srun starts one torchrun per node. ---"
cat <<EOF
#!/bin/bash
#SBATCH --job-name=ddp
#SBATCH --nodes=$nodes
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=$nproc
#SBATCH --cpus-per-task=$((nproc * 4))
export MASTER_ADDR=\$(scontrol show hostnames "\$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=$port
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
srun torchrun --nnodes=\$SLURM_NNODES --nproc_per_node=$nproc --rdzv-backend=c10d \\
    --rdzv-endpoint=\$MASTER_ADDR:\$MASTER_PORT --rdzv-id=\$SLURM_JOB_ID --max-restarts=3$tail_args
EOF
