"""The command line: serve, --check-config (plan), probes (kubelet probes), demo."""
