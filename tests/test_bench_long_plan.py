"""The long-context plan benchmark (section (i)) through its CLI: every length, and the sizes it predicts."""

import sys

from dflash_ddp.bench.__main__ import main


def test_the_long_context_plan_prints_each_length_for_qwen3_8b(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["python -m dflash_ddp.bench", "--only", "long_plan"])
    main()  # in this process: the plan runs nothing it could leak
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| dflash")]
    assert [r.split("|")[1].strip() for r in rows] == ["dflash"] * 5 + ["dflash2"] * 5
    assert [int(r.split("|")[2]) for r in rows[:5]] == [8192, 16384, 32768, 65536, 131072]
    # 64K tokens x 5 taps x 4096 x bf16 = 2.5 GiB a message
    assert "| 2.50 GiB | yes |" in rows[3]
    # DFlash2's codebooks: 2 x 151936 x 256 x 16 bytes (fp32 weights, gradients, AdamW's moments) = 1.16 GiB
    assert all("selector codebooks 1.16" in r for r in rows[5:]) and "codebooks" not in rows[0]
    assert (
        "dflash: longest that fits the memory: 131072 tokens; within the target's max_position_embeddings 40960"
        in out
    )
    assert "longest_context says): 32768;" in out
    # an H200 has room to keep every activation and score a chunk's loss in one piece
    assert "recompute none, gradient checkpointing off, loss pieces of 8192 rows: the fastest" in out
