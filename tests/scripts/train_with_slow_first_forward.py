"""`python -m dflash_ddp.train` whose drafter's first forward takes SLOW_FIRST_FORWARD_S seconds (as the first
compiled step on a GPU does): the job must not fail on --dist_timeout because of it."""

import os
import sys
import time

from dflash_ddp.drafter import model
from dflash_ddp.train import main

original_forward = model.DFlashDraftModel.forward
calls = []


def slow_first_forward(self, *args, **kwargs):
    if not calls:
        time.sleep(float(os.environ["SLOW_FIRST_FORWARD_S"]))
    calls.append(1)
    return original_forward(self, *args, **kwargs)


model.DFlashDraftModel.forward = slow_first_forward
sys.exit(main())
