"""Checkpoints in the contract layout: written aside and renamed so none is half-visible, verified by a
manifest, rotated, and read back to resume (`python -m dflash_ddp.checkpoint inspect|verify DIR`).
"""
