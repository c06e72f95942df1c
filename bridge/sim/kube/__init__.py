"""Stand-ins for the Kubernetes side of the node service and the platform agent.

``apiserver``: an in-process Kubernetes API server (PodGroups, Pods, Nodes, Events: list,
watch, get, patch, update, bindings, conflicts, expiry, restarts) that the official client
talks to unmodified; ``selectors``: label and field selectors as the real server parses
them; ``ascendjob``: an AscendJob's pods as ascend-operator, the scheduler and the kubelet
make them; ``podgroup_clusterd``: ClusterD's platform mode on the PodGroup store.

None is a real Kubernetes or a real ClusterD; each module says where it differs.
"""
