"""The loop each rank runs, picked once by train.py: a target rank, a drafter rank, both in one process
(colocated), the split calibration, and the drafter leader's evaluations around training.
"""
