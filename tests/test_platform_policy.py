"""The platform policy on its own: the TOML rules and the strategy decision."""

from __future__ import annotations

from pathlib import Path

import pytest

from bridge.platform.policy import Policy, PolicyError, Rules, Situation, decide, load_policy, policy_from_dict

EXAMPLE = Path(__file__).resolve().parent.parent / "contrib" / "platform-policy.example.toml"


# --------------------------------------------------------------------------- decide


@pytest.mark.parametrize(
    ("faults", "expected"),
    [
        ({3: 0}, "retry"),  # UCE only: retry
        ({3: 0, 4: 0}, "retry"),
        ({3: 2}, "recover"),  # HCCL is not in the default retry types
        ({3: 0, 4: 1}, "recover"),  # any type 1: never retry
        ({3: 1}, "recover"),
    ],
)
def test_default_rules(faults: dict[int, int], expected: str) -> None:
    decision = decide(Rules(), Situation(faults))
    assert decision.strategy == expected
    assert decision.rank_table == ("true" if expected == "recover" else "delete")


def test_hccl_retried_when_configured() -> None:
    assert decide(Rules(retry_fault_types=frozenset({0, 2})), Situation({1: 2, 2: 0})).strategy == "retry"


def test_no_retry_after_a_failed_retry() -> None:
    """The second confirm of a 405 cycle: ClusterD will not retry again, so answering
    retry would leave it only exit."""
    decision = decide(Rules(), Situation({3: 0}, after_failed_retry=True))
    assert decision.strategy == "recover"


def test_rank_table_modes() -> None:
    assert decide(Rules(rank_table="never"), Situation({1: 1})).strategy == "dump"
    external = Rules(rank_table="external")
    assert decide(external, Situation({1: 1})).strategy == "dump"
    assert decide(external, Situation({1: 1}, rank_table_ready="false")).strategy == "dump"
    ready = decide(external, Situation({1: 1}, rank_table_ready="true"))
    assert (ready.strategy, ready.rank_table) == ("recover", "keep")
    assert decide(external, Situation({1: 0})).rank_table == "keep"


def test_unusable_faults_get_on_malformed_whatever_prefer_says() -> None:
    assert decide(Rules(), Situation({}, unusable=True)).strategy == "dump"
    assert decide(Rules(on_malformed="exit"), Situation({3: 0}, unusable=True)).strategy == "exit"


def test_first_applicable_of_prefer_and_exit_when_none() -> None:
    assert decide(Rules(prefer=("dump", "retry")), Situation({3: 0})).strategy == "dump"
    assert decide(Rules(prefer=("retry",)), Situation({3: 1})).strategy == "exit"
    assert decide(Rules(prefer=("exit", "dump")), Situation({3: 0})).strategy == "exit"


def test_empty_faults_never_retry() -> None:
    assert decide(Rules(prefer=("retry",)), Situation({})).strategy == "exit"


# --------------------------------------------------------------------------- loading


def test_builtin_defaults() -> None:
    policy = load_policy(None)
    assert policy == Policy()
    assert policy.rules_for("anything") == Rules()
    assert policy.defaults.standing_strategy == "dump"


def test_example_file_loads_and_overrides_per_namespace() -> None:
    policy = load_policy(EXAMPLE)
    assert policy.defaults == Rules()
    research = policy.rules_for("research")
    assert research.prefer == ("retry", "dump")
    assert research.retry_fault_types == {0, 2}
    assert research.standing_strategy == "dump"  # inherited
    assert policy.rules_for("inference-batch").rank_table == "never"
    assert policy.rules_for("elsewhere") == policy.defaults
    assert policy.as_dict()["namespaces"]["research"]["retry_fault_types"] == [0, 2]


def test_namespace_inherits_changed_defaults() -> None:
    policy = policy_from_dict({"defaults": {"rank_table": "never", "standing_strategy": ""},
                               "namespaces": {"a": {"prefer": ["dump"]}}})
    assert policy.rules_for("a") == Rules(standing_strategy="", rank_table="never", prefer=("dump",))


def test_every_problem_reported_at_once(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(
        "[defaults]\n"
        'standing_strategy = "exit"\n'
        'prefer = ["retry", "retry"]\n'
        "retry_fault_types = [1]\n"
        'rank_table = "maybe"\n'
        'on_malformed = "retry"\n'
        "colour = 1\n"
        "[namespaces.x]\n"
        'prefer = "dump"\n'
        "[extra]\n"
    )
    with pytest.raises(PolicyError) as caught:
        load_policy(path)
    keys = [problem.split(":")[0] for problem in caught.value.problems]
    assert keys == ["extra", "defaults.colour", "defaults.standing_strategy", "defaults.prefer",
                    "defaults.retry_fault_types", "defaults.rank_table", "defaults.on_malformed",
                    "namespaces.x.prefer"]


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="No such file"):
        load_policy(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[defaults\n")
    with pytest.raises(PolicyError, match="broken.toml"):
        load_policy(broken)


def test_booleans_are_not_fault_types() -> None:
    with pytest.raises(PolicyError):
        policy_from_dict({"defaults": {"retry_fault_types": [False]}})
