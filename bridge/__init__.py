"""tft-bridge: hosts the MindIO TFT controller of a job and relays it to MindCluster ClusterD."""

from bridge._version import __version__

__all__ = ["__version__"]
