"""Simulated peers of the bridge (ClusterD and the MindIO TFT controller), for tests and the demo."""
