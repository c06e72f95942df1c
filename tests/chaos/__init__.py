"""The chaos runner: seeded random fault schedules over the simulated peers, on both
entry points (the daemon and a seed-API launcher), each checked against the invariants
a job's survival depends on.

    python -m tests.chaos --seed 7                 # one schedule
    python -m tests.chaos --schedules 1000         # a long run, with its figures
    python -m tests.chaos --replay '<json>'        # the schedule a failure printed

Modules: ``schedule`` (events, the generator, the recovery-path verdict), ``harness``
(the daemon and seed-API entry points), ``process`` (a real ``tft-bridge run``),
``runner`` (injection, settling, shrinking), ``invariants`` (the checks). The suite runs a
fixed set of seeds and one self-check per invariant (tests/test_chaos.py); the long-run
figures are in docs/chaos.md.
"""
