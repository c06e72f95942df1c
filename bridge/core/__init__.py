"""What every program of tft-bridge shares: configuration, logs, metrics endpoint, systemd, Kubernetes access, files."""
