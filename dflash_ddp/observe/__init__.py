"""What the user sees and what is recorded: the live progress display and metrics.jsonl, experiment
trackers, and PNG plots of a run.
"""
