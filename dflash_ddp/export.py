"""`python -m dflash_ddp.export CHECKPOINT_DIR OUT_DIR [--dtype bfloat16|float32] [--target_model DIR]`.

The serving export in the z-lab layout; the code lives in serving/export.py.
"""

import sys

from dflash_ddp.serving.export import main

if __name__ == "__main__":
    sys.exit(main())
