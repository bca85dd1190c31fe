"""Benchmarks behind ``ftis-fed bench ...``: each prints one JSON line of ratios measured side by
side in the same run (never bare absolute times: this machine's timings are noisy)."""
