"""Benchmarks of the episode router against nginx, HAProxy and Envoy, and its micro-benchmarks.

`python -m bench.run` starts trivial workers, the router and the peer proxies it
finds installed, drives each with the same load and prints CPU per request,
throughput and added latency side by side. `python -m bench.micro` measures the
claim table, token parsing, the control socket, streaming and idle connections.
Both take `--quick` for a run of a few seconds; see docs/performance.md.

Nothing here is imported by the router: the package only measures it from outside,
over loopback and the OS's own process accounting.
"""
