"""`python -m dflash_ddp.train` whose drafter forwards each take SLOW_STEP_S seconds longer: a job small
enough to finish in a second lasts long enough to be stopped in the middle."""

import os
import sys
import time

from dflash_ddp.drafter import model
from dflash_ddp.train import main

original_forward = model.DFlashDraftModel.forward


def slow_forward(self, *args, **kwargs):
    time.sleep(float(os.environ["SLOW_STEP_S"]))
    return original_forward(self, *args, **kwargs)


model.DFlashDraftModel.forward = slow_forward
sys.exit(main())
