"""The per-job bridge: one MindIO TFT controller hosted and relayed to ClusterD."""
