"""The long-context plan benchmark (section (i)) through its CLI: every length, and the sizes it predicts."""

import subprocess
import sys


def test_the_long_context_plan_prints_each_length_for_qwen3_8b():
    out = subprocess.run(
        [sys.executable, "-m", "dflash_ddp.bench", "--only", "long_plan"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [int(r.split("|")[1]) for r in rows] == [8192, 16384, 32768, 65536, 131072]
    # 64K tokens x 5 taps x 4096 x bf16 = 2.5 GiB a message, as the 2.6 GB
    assert "| 65536 |" in out and "| 2.50 GiB | yes |" in rows[3]
    assert "longest that fits: 131072 tokens" in out
