"""Run under torchrun: `dflash_ddp.train` where each rank reads its own --data file (argv: one file per
rank, then the other flags), as when every node of a multi-node job reads a local copy of the data."""

import os
import sys

from dflash_ddp.train import main

if __name__ == "__main__":
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    files, flags = sys.argv[1 : 1 + world], sys.argv[1 + world :]
    sys.exit(main(["--data", files[rank], *flags]))
