"""The report path: the controller's callbacks to ClusterD's Report RPCs, and what they tell the bridge."""
