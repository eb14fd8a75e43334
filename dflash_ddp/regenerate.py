"""`[torchrun ...] python -m dflash_ddp.regenerate --target_model DIR --data IN.jsonl --out OUT.jsonl`.

Regenerates the assistant turns of chat data with the target; the code lives in regeneration/.
"""

import sys

from dflash_ddp.regeneration.regenerate import main

if __name__ == "__main__":
    sys.exit(main())
