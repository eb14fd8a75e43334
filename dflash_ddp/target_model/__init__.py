"""The frozen target model: its shape and fingerprint, loading it (whole or sharded across a
tensor-parallel group), running it only as far as the drafter needs, and its shared embedding and LM head.
"""
