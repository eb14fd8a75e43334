"""Benchmarks: figures printed side by side in one run, not timed tests. Run `python -m dflash_ddp.bench`.

(a)-(c) the split job on CPU/gloo (channel.py); (d) the trainer against a plain loop around transformers'
DFlash drafter (speed.py, plain_loop.py); (e)-(f) the drafter's step: dense vs block-sparse attention,
and the paper's recipe in chunks with its predicted memory (drafter.py); (g) the objective variants by real
tau on two targets (method.py, `--method`); (h) a step's cost by part for the defaults, the paper's recipe
and the plain loop (step_cost.py, `--only steps`); (i) `--plan`'s memory for Qwen3-8B at 8K-128K tokens
per sequence (long_plan.py, `--only long_plan`); (k) vLLM beside this project: tau by temperature in both
decoders and regeneration's rows/s (engines.py, `--only engine_tau,regeneration`).
"""
