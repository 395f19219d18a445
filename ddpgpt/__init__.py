"""ddpgpt: everything the scripts at the root of the repository import, one module per concern.
docs/training.md ("The scripts") says which concern lives in which module.

Nothing is imported here, so that a script (or a benchmark) pays only for what it uses."""
