"""The DFlash drafter: the model and its z-lab serving layout, block-sparse and flex attention, the
training objective (anchors, blocks, weighted loss) and one optimizer step of the trainer.
"""
