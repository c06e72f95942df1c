"""Scheduling helpers of the per-job bridge: CPU affinity, realtime priority, gRPC internals."""
