"""The parallel-strategy advisor: an analytic cost model of every uniform layout (DP, TP, PP,
EP, CP, micro-batches, recompute, distributed optimizer), calibrated on what meshscope measured
in a job's own runs. It reads run stores and imports nothing of ours but the collector."""
