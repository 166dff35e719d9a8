"""health-sidecar: role-aware canary health checks for LLM inference workers."""

__version__ = "0.1.0"
