"""The fleet bench: simulated GPU engines, synthetic traces, and a replayer that drives
several front doors through the same fleet side by side (see bench/README.md)."""
