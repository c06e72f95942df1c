"""The job's ClusterD session: its channel, signal stream, auxiliary streams and their rules."""
