"""The serving export (`python -m dflash_ddp.export`): a checkpoint to the z-lab layout that SGLang, vLLM
and transformers load, stamped with how it was trained.
"""
