"""Hosting the job's MindIO TFT controller: finding it, loading it, calling it."""
