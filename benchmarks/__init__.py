"""Benchmarks: meshspeed side by side with its peers, one run each. Run them from the repository
root as modules, `python -m benchmarks.train_step --help` (docs/benchmarks.md lists them all);
what they share is in `benchmarks.harness` (spawning, counting, timing, agreement) and
`benchmarks.peers` (torch's own DDP, ZeroRedundancyOptimizer, FSDP2 and DTensor TP)."""
