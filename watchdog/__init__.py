"""Hangs and broken collectives: the pure diagnosis, the runtime watch beside the workers, the
exchange between nodes, and PyTorch Flight Recorder dumps. Imports only `meshscope.collector`
of ours; it never talks through the process group that is stuck."""
