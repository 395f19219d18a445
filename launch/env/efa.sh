# shellcheck shell=bash
# launch/env/efa.sh - network settings for AWS EFA clusters (p4d, p5, p5e, p6...), for current
# software: NCCL >= 2.18, aws-ofi-nccl >= 1.7, libfabric >= 1.18 (EFA installer >= 1.29).
# Sourced by launch/srun.sh on the first node; srun passes the variables to every rank:
#
#   LAUNCH_ENV=launch/env/efa.sh sbatch --nodes=4 launch/slurm.sbatch config/owt.py
#
# It is short on purpose: NCCL and aws-ofi-nccl detect EFA, GPUDirect RDMA and the instance's
# topology by themselves. Check with NCCL_DEBUG=INFO that the log says "NET/OFI" and
# "Using network Libfabric" (or "AWS Libfabric"), not "Using network Socket".

# The aws-ofi-nccl plugin and libfabric, where the EFA installer puts them (older installers:
# /opt/aws-ofi-nccl/lib). NCCL finds its network plugin through LD_LIBRARY_PATH.
for _d in /opt/amazon/efa/lib /opt/aws-ofi-nccl/lib /opt/amazon/ofi-nccl/lib; do
  if [ -d "$_d" ]; then
    case ":${LD_LIBRARY_PATH:-}:" in
      *":$_d:"*) ;;
      *) export LD_LIBRARY_PATH="$_d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
    esac
  fi
done
unset _d

# The interface for NCCL's bootstrap (a TCP connection per rank at start-up; the data goes
# over EFA): any but loopback and container bridges. Set your own, e.g. "en" or "ens32", if
# start-up hangs at "Bootstrap". GLOO_SOCKET_IFNAME takes exact names only (no "^"); set it
# (e.g. GLOO_SOCKET_IFNAME=ens32) only for CPU runs with backend=gloo on multi-NIC nodes.
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker}

# Only if os.fork() fails with "Cannot allocate memory" (torch.compile's worker processes,
# DataLoader workers): libfabric's huge pages then starve the fork. Costs a little speed.
# export FI_EFA_USE_HUGE_PAGE=0

# Variables from older advice that do not belong here any more - remove them:
#   NCCL_TREE_THRESHOLD=...           removed in NCCL 2.5; NCCL's tuner picks tree or ring
#   NCCL_PROTO=simple                 a debugging setting (was needed by aws-ofi-nccl <= 1.5);
#                                     it turns off the LL/LL128 protocols and slows small
#                                     messages down
#   FI_EFA_ENABLE_SHM_TRANSFER=0      deprecated in libfabric (FI_EFA_INTRANODE_PROVIDER
#                                     replaced it); NCCL moves intra-node data over NVLink
#   FI_PROVIDER=efa                   needed by aws-ofi-nccl <= 1.5 only
#   FI_EFA_USE_DEVICE_RDMA=1          automatic with libfabric >= 1.18 on p4/p5
#   FI_EFA_FORK_SAFE=1                not needed on kernels >= 5.15
#   RDMAV_FORK_SAFE=1, RDMAV_*        rdma-core settings that can break libfabric on new kernels
#   NCCL_ASYNC_ERROR_HANDLING=1       renamed TORCH_NCCL_ASYNC_ERROR_HANDLING; its default (3)
#                                     is right: a timed-out collective ends the process
#   NCCL_TIMEOUT=...                  not an NCCL variable: the collective timeout is train.py's
#                                     --dist_timeout_s
#   NCCL_BUFFSIZE, NCCL_MIN_NCHANNELS, NCCL_NSOCKS_PERTHREAD, NCCL_SOCKET_NTHREADS
#                                     defaults are tuned for EFA; the socket ones do not apply
#   FI_EFA_SET_CUDA_SYNC_MEMOPS=0     a workaround for EFA installer < 1.29.1 with NCCL >= 2.19
