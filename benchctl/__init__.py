"""benchctl: a benchmarking and evaluation harness that compares language-model architectures fairly."""

__version__ = "0.1.0"
