"""train.py, launched in its place, that prints the dtypes of the first block's inputs at its
first forward on each rank: what the residual stream is computed in (ddp's autocast and fsdp's
mixed precision must agree). Used by test_fsdp.py."""
import os
import sys

import torch

from as_train import run_train
from ddpgpt import parallel

_wrap = parallel.wrap


def wrap_and_watch(model, *args, **kw):
    wrapped = _wrap(model, *args, **kw)

    def show(block, inputs):
        dtypes = [str(t.dtype).removeprefix("torch.") for t in inputs
                  if isinstance(t, torch.Tensor)]
        sys.stdout.write(f"block inputs (rank {os.environ.get('RANK', 0)}): "
                         f"{' '.join(dtypes)}\n")  # one write: the ranks share the pipe
        sys.stdout.flush()
        handle.remove()

    handle = model.transformer.h[0].register_forward_pre_hook(show)
    return wrapped


parallel.wrap = wrap_and_watch

if __name__ == "__main__":
    run_train(sys.argv[1:])
