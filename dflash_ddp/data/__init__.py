"""Training data: conversation files and `save_to_disk` directories, chat templates and the assistant-only
loss mask, the tokenized dataset cached on disk, and the seeded schedule of global batches.
"""
