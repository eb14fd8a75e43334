"""A run before its first step: the drafter's settings decided from the target, the tokenized data and
schedule, the memory model and --plan, the split calibration, and where to start (resume checks).
"""
