"""sglang-watchdog: a self-healing liveness watchdog for SGLang prefill-decode serving."""

__version__ = "0.1.0"
