"""Real speculative decoding with a drafter (tau, speed, the lossless check), the watcher that evaluates a
run's checkpoints as they appear, and the eval.jsonl records it keeps.
"""
