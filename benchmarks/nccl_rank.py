"""bench gpu's collectives check: one process in a one-rank process group over the backend given
(nccl on the GPU; gloo in a dry run), through which every multi-GPU path of ddpgpt runs its
collectives once: DDP's all-reduce; fully_shard's all-gather and reduce-scatter; Muon's
all_gather_single (ddp), and its all_to_all_single and NorMuon's all_reduce (fsdp). A one-rank
group starts NCCL as eight ranks do (device_id, communicator, kernels), on the one GPU a check
has.

  torchrun --standalone --nproc_per_node=1 -m benchmarks.nccl_rank DEVICE BACKEND DTYPE

Prints one JSON line: the backend, read from the process group, and each path's losses.
"""
import json
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpgpt import optim, parallel, runtime
from ddpgpt.model import GPT, GPTConfig
from ddpgpt.settings import TrainConfig

MODEL = dict(n_layer=2, n_head=4, n_embd=128, block_size=64, vocab_size=320, arch="modern",
             bias=False)
STEPS = 4


def losses(cfg, device, dtype):
    """STEPS optimizer steps of Muon and AdamW on one random batch, the model shared out by
    cfg.parallel over the one rank: the losses, which must fall."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL)).to(device)
    if cfg.parallel == "fsdp":
        parallel.shard(model, device, dtype, True, False)  # in place
        train_model = model
    else:
        train_model = DDP(model, device_ids=[torch.device(device).index] if device != "cpu"
                          else None)
    optimizer = optim.make(cfg, model, runtime.device_type(device))
    x = torch.randint(0, 257, (4, MODEL["block_size"]), device=device)
    out = []
    for _ in range(STEPS):
        with runtime.precision(dtype, device).autocast:
            loss = train_model(x, x)[1]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


def main(device, backend, dtype):
    runtime.use_device(device)
    dist.init_process_group(backend, device_id=torch.device(device) if backend == "nccl" else None)
    # recipe two's pieces on: NorMuon's all_reduce under fsdp, and cautious AdamW's DTensors
    cfg = TrainConfig(optimizer="muon", arch="modern", learning_rate=1e-3, dtype=dtype,
                      muon_coefficients="polar_express", muon_beta2=0.95,
                      cautious_weight_decay=True)
    result = {"backend": dist.get_backend(), "world_size": dist.get_world_size()}
    for kind in ("ddp", "fsdp"):
        result[kind] = losses(TrainConfig(**{**cfg.__dict__, "parallel": kind}), device, dtype)
    dist.destroy_process_group()
    print(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
