"""The ceiling for train.py's speed: nanoGPT's training loop at its barest, on the model, batch,
device, dtype and compile setting that train.py's own arguments give, with no data path (random
batches made on the device once), no evaluation, no checkpoints and no logging. Each step is
timed between torch.cuda.synchronize() calls. Prints one JSON line: ms per step, peak memory.

  python -m bench.minimal_loop config/owt.py --device=cuda --data_dir=<data> --max_iters=20
"""
import json
import sys
import time

import torch

import configurator
import tokenfile
import startup
import train
from model import GPT, GPTConfig


def main(argv):
    cfg = configurator.parse(train.TrainConfig, argv)
    device = startup.pick_device(cfg.device, local_rank=0)
    device_type = torch.device(device).type
    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    if device_type == "cuda":  # as train.py and nanoGPT set them
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(**startup.model_args(cfg, tokenfile.read_meta(cfg.data_dir))))
    model.to(device)
    # the same AdamW as train.py's (fused on CUDA) with the same parameter groups
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate,
                                           (cfg.beta1, cfg.beta2), device_type)
    trained = torch.compile(model) if cfg.compile else model
    autocast = train.autocast_for(startup.pick_dtype(cfg, device_type), device_type)
    micro_steps, shape = cfg.gradient_accumulation_steps, (cfg.batch_size, cfg.block_size)
    batches = [(torch.randint(model.config.vocab_size, shape, device=device),
                torch.randint(model.config.vocab_size, shape, device=device))
               for _ in range(micro_steps)]
    ms = []
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
    peak = torch.cuda.max_memory_allocated(device) if device_type == "cuda" else None
    print(json.dumps({"ms": ms, "peak_mem": peak, "loss": loss.item()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
