"""OpenMP's threads on the CPU, set before torch is imported: libgomp reads its environment
once, when torch loads it."""
import os


def wait_passively():
    """Unless the user chose (OMP_WAIT_POLICY), OpenMP's threads sleep while they wait for each
    other instead of spinning: on a loaded machine a spinning thread takes the core that the thread
    it waits for needs, and sample.py's or eval.py's default threads ran many times slower than one
    (docs/sampling.md has the figures). The thread count, and so every result, stays what it was."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
