"""`python -m dflash_ddp.regenerate` with a pause after each batch written to disk, so that a test can kill
the job while some but not all rows are finished (on the tiny test target a whole run takes about a second).

The pause in seconds is the first argument; the rest are the tool's own flags."""

import sys
import time

from dflash_ddp.regeneration import regenerate

PAUSE_S = float(sys.argv.pop(1))
write = regenerate.PartWriter.write


def write_then_pause(self, records):
    write(self, records)
    time.sleep(PAUSE_S)


regenerate.PartWriter.write = write_then_pause
sys.exit(regenerate.main())
