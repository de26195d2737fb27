"""The speculative-decoding orchestrator: paged KV, recurrent-state commit, batching, rounds.

Boundary: reads an engine directory only; never imports torch or the checkpoint code.
"""
