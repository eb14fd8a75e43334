"""Training data: conversation files and hub-free sources, chat templates and the assistant-only loss mask,
the tokenized dataset cached on disk, and the seeded schedule of global batches.
"""
