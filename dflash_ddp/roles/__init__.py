"""The loop each rank runs, picked once by train.py: a target rank, a drafter rank, both in one process
(colocated), and every rank's loop of a run that trains no step (step_zero.py).
"""
