"""The reference trainer: an instrumented MoE language model trained under torchrun.

It measures itself only through `collector.Monitor`, as a user's own loop would.
"""
