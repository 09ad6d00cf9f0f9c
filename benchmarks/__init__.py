"""Benchmarks and experiments (``omnidraft bench``, ``adapt``, ``drift``, the service benchmark),
their datasets (HumanEval, Python's docs, personal codebases) and the tiny models of the tests
and the one-minute simulation. The device and the coordinator never import this package."""
