"""`python -m dflash_ddp.plot RUN_DIR [--out DIR]`: PNG plots of a run's metrics (observe/plot.py)."""

import sys

from dflash_ddp.observe.plot import main

if __name__ == "__main__":
    sys.exit(main())
