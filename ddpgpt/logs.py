"""The lines a run prints, through the standard logging module: each module logs to its own
logger (logging.getLogger(__name__); the scripts to 'ddpgpt.train', 'ddpgpt.eval', ...), all
under the 'ddpgpt' logger, which setup() configures once per process."""
import logging
import sys

NAME = "ddpgpt"


def setup(master=True, stream=None):
    """Print the 'ddpgpt' loggers' lines (INFO and up) on rank 0 (master), each as it is
    ("%(message)s": no level, no time) and flushed, to stream (sys.stdout when None); nothing
    on other ranks, so that a log the ranks share holds one copy of each line. The lines go to
    this handler alone (propagate False: none twice through a handler of the root logger, none
    through logging's last resort on other ranks). Called again, it replaces the set-up."""
    logger = logging.getLogger(NAME)
    for old in list(logger.handlers):
        logger.removeHandler(old)
    if master:
        handler = logging.StreamHandler(sys.stdout if stream is None else stream)
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = logging.NullHandler()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
