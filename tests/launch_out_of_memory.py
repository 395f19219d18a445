"""train.py on a GPU too small for its settings, launched in its place: the model's first forward
raises torch's out-of-memory error (on 2+ ranks that is DDP's gradient-bucket pass inside the
wrap, on 1 the iter-0 evaluation), and torch.cuda reports an 80 GiB device. Used by
test_memplan.py."""
import sys
from types import SimpleNamespace

import torch

from as_train import run_train
from ddpgpt.model import GPT


def out_of_memory(*args, **kw):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
                                 "total capacity of 79.19 GiB")


GPT.forward = out_of_memory
torch.cuda.get_device_properties = lambda device: SimpleNamespace(total_memory=80 * 2**30)

if __name__ == "__main__":
    run_train(sys.argv[1:])
