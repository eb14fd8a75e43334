"""Regenerating the assistant turns of chat data with the target itself (`python -m dflash_ddp.regenerate`),
written in resumable per-rank parts and merged.
"""
