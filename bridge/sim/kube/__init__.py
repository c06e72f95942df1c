"""Stand-ins for the platform agent's peers, for its tests and demos.

``apiserver``: an in-process Kubernetes API server for PodGroups only (list, watch,
get, merge patch, update, resourceVersion conflicts, watch expiry, restarts).
``clusterd``: ClusterD's platform-mode behaviour on the PodGroup annotations.

Neither is a real Kubernetes or a real ClusterD; see each module for where it differs.
"""
