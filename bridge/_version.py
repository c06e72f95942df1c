"""The single place the version lives; read by setup (dynamic version) and the package."""

__version__ = "0.1.0"
