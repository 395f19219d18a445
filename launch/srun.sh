#!/usr/bin/env bash
# launch/srun.sh - run train.py on every node of the current SLURM allocation: one torchrun
# per node, c10d rendezvous on the allocation's first node. Use it inside salloc or from a
# batch script; launch/slurm.sbatch calls it. Arguments go to train.py unchanged:
#
#   salloc --nodes=2 --gpus-per-node=8 --exclusive
#   launch/srun.sh config/owt.py --batch_size=16
#
# Environment (all optional):
#   NPROC_PER_NODE  ranks per node; default: the allocation's GPUs per node (CPU nodes: set it)
#   LAUNCHER        torchrun (default): one torchrun per node, which starts the ranks;
#                   srun: one srun task per rank, no torchrun (train.py reads SLURM_PROCID,
#                   SLURM_LOCALID and SLURM_NTASKS, and MASTER_ADDR/MASTER_PORT set here)
#   RDZV_PORT       the rendezvous port; default: derived from the job id (rdzv_port below)
#   RDZV_TIMEOUT_S  how long the nodes wait for each other at start-up (default 600)
#   MAX_RESTARTS    torchrun's --max-restarts (default 0): when a rank dies, every torchrun
#                   restarts its ranks up to this many times within the job; give
#                   --init_from=auto (slurm.sbatch does) so that they resume
#   LAUNCH_ENV      a file to source first, e.g. launch/env/efa.sh (it reaches every rank)
#   PYTHON          the interpreter that has torch (default python3 from PATH)
#   TRAIN_SCRIPT    the script to run (default train.py beside this folder)
#   TORCH_FR_BUFFER_SIZE, TORCH_NCCL_DUMP_ON_TIMEOUT, TORCH_FR_DUMP_TEMP_FILE  NCCL's flight
#                   recorder, on by default (below); set any of them to override it
#
# The ranks run with SIGUSR1 and SIGTERM ignored until train.py catches them, and
# torchrun itself ignores both: a signal for the step (srun forwards USR1; slurm sends TERM
# on scancel, time limit or preemption) reaches every rank, the ranks agree on the step to
# stop at, rank 0 saves, and all exit 0 - torchrun does not kill them half-way through.
# The last command execs srun, so this script's PID is srun's: kill -USR1 it to stop.
set -euo pipefail

die() { echo "srun.sh: $*" >&2; exit 2; }

# The rendezvous port, the one place it is decided: one per job, so that two jobs that share
# a node never collide, and in 20000-28999, below the ephemeral range that Linux hands out
# to outgoing connections (32768-60999 by default), so that no client socket can hold it.
rdzv_port() { echo $((20000 + $1 % 9000)); }

[ -n "${SLURM_JOB_ID:-}" ] || die "not inside a SLURM allocation (no SLURM_JOB_ID): run it
inside salloc or a batch script, or submit launch/slurm.sbatch with sbatch"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ -n "${LAUNCH_ENV:-}" ]; then
  [ -r "$LAUNCH_ENV" ] || die "LAUNCH_ENV=$LAUNCH_ENV cannot be read"
  # shellcheck source=/dev/null
  source "$LAUNCH_ENV"
fi
PYTHON=${PYTHON:-python3}
TRAIN_SCRIPT=${TRAIN_SCRIPT:-$(dirname "$here")/train.py}
LAUNCHER=${LAUNCHER:-torchrun}
RDZV_TIMEOUT_S=${RDZV_TIMEOUT_S:-600}
MAX_RESTARTS=${MAX_RESTARTS:-0}
case $MAX_RESTARTS in
  '' | *[!0-9]*) die "MAX_RESTARTS=$MAX_RESTARTS: give a number of restarts, e.g. 3" ;;
esac
[ "$MAX_RESTARTS" = 0 ] || [ "$LAUNCHER" = torchrun ] || die "MAX_RESTARTS=$MAX_RESTARTS \
needs LAUNCHER=torchrun: with one srun task per rank, a dead rank ends the job"

nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
head_node=$(head -n1 <<<"$nodes")
n_nodes=$(wc -l <<<"$nodes")
port=${RDZV_PORT:-$(rdzv_port "$SLURM_JOB_ID")}
if read -r eph_lo _ </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null && [ "$port" -ge "$eph_lo" ]; then
  echo "srun.sh: warning: port $port is in this node's ephemeral range (from $eph_lo)" >&2
fi

# ranks per node: NPROC_PER_NODE, else the GPUs that SLURM gave each node
gpus_per_node() {
  if [ -n "${SLURM_GPUS_ON_NODE:-}" ]; then echo "$SLURM_GPUS_ON_NODE"; return; fi
  if [ -n "${SLURM_GPUS_PER_NODE:-}" ]; then echo "${SLURM_GPUS_PER_NODE##*:}"; return; fi
  # salloc on a login node with --gres=gpu:N sets neither: ask one node
  srun --nodes=1 --ntasks=1 --ntasks-per-node=1 printenv SLURM_GPUS_ON_NODE 2>/dev/null || true
}
nproc=${NPROC_PER_NODE:-$(gpus_per_node)}
case $nproc in
  '' | 0 | *[!0-9]*) die "cannot tell how many ranks to start per node (GPUs per node: \
'${nproc}'): request GPUs with --gpus-per-node=N, or set NPROC_PER_NODE (e.g. on CPU nodes)" ;;
esac

echo "srun.sh: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $n_nodes node(s) x" \
     "$nproc rank(s), $LAUNCHER, rendezvous $head_node:$port, max restarts $MAX_RESTARTS"

# NCCL's flight recorder: each rank keeps its last collectives in memory and writes them to
# <prefix><rank> when a collective times out (dist_timeout_s), or the hang watchdog fires
# (hang_timeout_s, which comes first), for torch's analyser
# (launch/README.md). torch 2.13 reads TORCH_FR_*; the TORCH_NCCL_* names it replaced still
# work, with a deprecation warning, so a value given under either name wins.
export TORCH_FR_BUFFER_SIZE=${TORCH_FR_BUFFER_SIZE:-${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}}
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
fr_default=$PWD/flight_recorder/$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}/rank_
export TORCH_FR_DUMP_TEMP_FILE=${TORCH_FR_DUMP_TEMP_FILE:-${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-$fr_default}}
echo "srun.sh: NCCL flight recorder: the last $TORCH_FR_BUFFER_SIZE collectives of each rank," \
     "written on a collective timeout to ${TORCH_FR_DUMP_TEMP_FILE}<rank>"
# the ranks must take their ranks from torchrun or srun, never from a stray shell variable
unset RANK LOCAL_RANK WORLD_SIZE GROUP_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT

# --kill-on-bad-exit: one rank (or torchrun) that exits non-zero ends the whole step at once,
# instead of the other ranks waiting in a collective until dist_timeout_s
step=(srun --nodes="$n_nodes" --kill-on-bad-exit=1)
case $LAUNCHER in
  torchrun)
    # one task per node: is_host makes the first node host the rendezvous store, rather
    # than relying on torchrun matching the hostname; torchrun ignores USR1/TERM
    # (--signals-to-handle without SIGTERM) and leaves them to the ranks. A restart
    # (--max-restarts) stays inside this job step: --kill-on-bad-exit acts only when a
    # torchrun gives up
    # shellcheck disable=SC2016  # the inner script's variables expand on each node
    exec "${step[@]}" --ntasks="$n_nodes" --ntasks-per-node=1 bash -c '
      trap "" USR1 TERM
      mkdir -p "$(dirname "$TORCH_FR_DUMP_TEMP_FILE")"
      [ "$SLURMD_NODENAME" = "$1" ] && is_host=1 || is_host=0
      exec "$2" -m torch.distributed.run --nnodes="$3" --nproc-per-node="$4" \
        --rdzv-backend=c10d --rdzv-endpoint="$1:$5" --rdzv-id="$SLURM_JOB_ID" \
        --rdzv-conf="is_host=$is_host,join_timeout=$6" --max-restarts="$7" \
        --signals-to-handle=SIGINT,SIGHUP,SIGQUIT "${@:8}"' \
      bash "$head_node" "$PYTHON" "$n_nodes" "$nproc" "$port" "$RDZV_TIMEOUT_S" \
      "$MAX_RESTARTS" "$TRAIN_SCRIPT" "$@" ;;
  srun)
    export MASTER_ADDR=$head_node MASTER_PORT=$port
    # shellcheck disable=SC2016  # the inner script's variables expand in each task
    exec "${step[@]}" --ntasks="$((n_nodes * nproc))" --ntasks-per-node="$nproc" \
      bash -c 'trap "" USR1 TERM; mkdir -p "$(dirname "$TORCH_FR_DUMP_TEMP_FILE")"; exec "$@"' \
      bash "$PYTHON" "$TRAIN_SCRIPT" "$@" ;;
  *) die "LAUNCHER=$LAUNCHER: use torchrun or srun" ;;
esac
