"""The simulations: the bridge's peers played on one machine, for tests, benchmarks and the demo.

Front doors:

* ``tft-bridge demo`` (:mod:`bridge.sim.demo`): one recovery end to end, printed as it happens;
* ``tft-bridge sim-clusterd`` (:mod:`bridge.sim.cli`): the simulated ClusterD on its own;
* :class:`bridge.sim.scenario.SimulatedJob`: a simulated ClusterD, the stub controller
  and a real bridge on loopback, for tests and benchmarks.

The peers: :mod:`bridge.sim.clusterd` (ClusterD's gRPC services, ``SimClusterD``/``SimJob``;
the ``clusterd_*`` modules are its parts, ``clusterd_rules`` the rules both ClusterD
simulations share), :mod:`bridge.sim.mindio_ttp` (the MindIO TFT controller), and
:mod:`bridge.sim.kube` (a stand-in Kubernetes API server, AscendJob pods, and ClusterD's
platform mode on its PodGroups). The product never imports this package: the CLI finds
the demo and ``sim-clusterd`` by name, the controller host finds the stub controller by
name (``bridge.job.host.controller.STUB_PACKAGE``); tests/test_layout.py holds that.
"""
