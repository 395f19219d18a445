"""The ceiling for train.py's speed: nanoGPT's training loop at its barest, on the model, batch,
device, dtype and compile setting that train.py's own arguments give, with no data path (random
batches made on the device once), no evaluation, no checkpoints and no logging. Each step is
timed between torch.cuda.synchronize() calls. Prints one JSON line: ms per step, peak memory,
each step's loss (its last micro-step's: the same batches every step, so it falls).

  python -m benchmarks.minimal_loop config/owt.py --device=cuda --data_dir=<data> --max_iters=20
"""
import json
import sys
import time

import torch

from ddpgpt import arch, configurator, optim, runtime, tokenfile
from ddpgpt.model import GPT, GPTConfig
from ddpgpt.settings import TrainConfig


def main(argv):
    cfg = configurator.parse(TrainConfig, argv, "benchmarks/minimal_loop.py")
    device = runtime.pick_device(cfg.device, runtime.Ranks(0, 0, 1, 1))
    device_type = runtime.device_type(device)
    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    runtime.use_device(device)  # the GPU and TF32, as train.py sets them
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(**arch.model_args(cfg, tokenfile.read_meta(cfg.data_dir))))
    model.to(device)
    # the same optimizer as train.py's (AdamW fused on CUDA, or Muon and AdamW) with the same
    # parameter groups
    optimizer = optim.make(cfg, model, device_type)
    trained = torch.compile(model) if cfg.compile else model
    autocast = runtime.precision(cfg.dtype, device).autocast
    micro_steps, shape = cfg.gradient_accumulation_steps, (cfg.batch_size, cfg.block_size)
    batches = [(torch.randint(model.config.vocab_size, shape, device=device),
                torch.randint(model.config.vocab_size, shape, device=device))
               for _ in range(micro_steps)]
    ms, losses = [], []
    for _ in range(cfg.max_iters):
        sync()
        t0 = time.perf_counter()
        for x, y in batches:
            with autocast:
                _, loss = trained(x, y)
            (loss / micro_steps).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        ms.append((time.perf_counter() - t0) * 1000)
        losses.append(loss.item())  # after the clock: the step has ended
    peak = torch.cuda.max_memory_allocated(device) if device_type == "cuda" else None
    print(json.dumps({"ms": ms, "peak_mem": peak, "losses": losses}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
