"""train.py with torch.compile's backend set to aot_eager, launched in place of train.py: dynamo
traces each compiled module and AOTAutograd its backward, as with inductor, but no code is
generated, so that a test of compile=True takes seconds on a CPU instead of minutes. Used by
test_fsdp.py."""
import sys

import torch

from as_train import run_train

_compile = torch.nn.Module.compile
_compile_fn = torch.compile


def eager_module_compile(self, *args, **kw):
    return _compile(self, *args, **{**kw, "backend": "aot_eager"})


def eager_compile(model=None, **kw):
    return _compile_fn(model, **{**kw, "backend": "aot_eager"})


torch.nn.Module.compile = eager_module_compile
torch.compile = eager_compile

if __name__ == "__main__":
    run_train(sys.argv[1:])
