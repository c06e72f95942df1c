"""Reading ClusterD's ``ProcessConfirmFault`` and writing the agent's ``ProcessResultFault``.

ClusterD's confirm text is read the way ClusterD reads it (``parse_faults(strict=False)``),
so the agent sees the same ranks ClusterD will use, and counts what ClusterD drops,
rejects or is poisoned by. The answer is always ``format_faults`` output, the one form
ClusterD parses safely: ``^\\d+:[012](,\\d+:[012])*$`` or empty.

A *poisoned* confirm (a kept rank that is not an integer, ``"4:1, 2:1"``) makes ClusterD
run its cycle with no ranks at all, and the agent cannot repair that: ClusterD merges its
own in-memory copy of the confirm back in. The agent still answers with the elements it
can read (the "salvaged" faults, below), never echoes a bad element, and its policy picks
the strategy for unreadable faults (``on_malformed``, ``dump`` by default).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

# ClusterD's text rules (its split of an annotation, Go's Atoi) have one home, the
# reference codec; lenient parsing runs there whichever twin is active.
from bridge.faults._python import clusterd_elements, go_atoi
from bridge.faults import LenientParse, format_faults, merge_faults, parse_faults

#: The only form the agent ever writes (or the empty string).
CANONICAL = re.compile(r"\d+:[012](,\d+:[012])*")


@dataclass(frozen=True)
class ConfirmReading:
    """What the agent makes of one confirm text.

    ``clusterd`` is ClusterD's own reading; ``faults`` the ranks the agent answers for:
    ClusterD's reading, or, when that is poisoned, the salvaged elements.
    """

    text: str
    clusterd: LenientParse
    faults: dict[int, int]

    @property
    def poisoned(self) -> bool:
        return self.clusterd.poisoned

    def malformed_counts(self) -> dict[str, int]:
        """Counts by kind (``dropped``, ``rejected``, ``poisoned``), zero kinds left out."""
        counts = {
            "dropped": len(self.clusterd.dropped),
            "rejected": len(self.clusterd.rejected),
            "poisoned": int(self.clusterd.poisoned),
        }
        return {kind: n for kind, n in counts.items() if n}


def read_confirm(text: str) -> ConfirmReading:
    parsed: LenientParse = parse_faults(text, strict=False)
    faults = salvage(text) if parsed.poisoned else dict(parsed.faults)
    return ConfirmReading(text, parsed, faults)


def salvage(text: str) -> dict[int, int]:
    """ClusterD's reading of ``text`` without the elements whose rank is not an integer.

    ClusterD converts all kept ranks as one list, so one bad rank empties it; here each
    such element is left out instead and the rest is read with ClusterD's own rules
    (duplicates are per rank text, so leaving elements out changes no other entry).
    Equal to ClusterD's reading whenever that is not poisoned.
    """
    kept = [element for element in clusterd_elements(text) if _convertible(element)]
    return dict(parse_faults(",".join(kept), strict=False).faults) if kept else {}


def _convertible(element: str) -> bool:
    """Exactly one ``:`` and a rank Go's ``strconv.Atoi`` accepts (int64)."""
    parts = element.split(":")
    return len(parts) == 2 and go_atoi(parts[0]) is not None


def result_for(confirm: Mapping[int, int], platform: Mapping[int, int]) -> tuple[dict[int, int], str]:
    """The faults the agent confirms and their canonical text.

    ``merge_faults`` is ClusterD's rule (type 1 sticky, otherwise the later wins), so
    platform knowledge can add ranks or raise 0/2 to 1 and never lowers ClusterD's 1.
    The text is checked against ClusterD's parser before it is returned: the agent would
    rather fail loudly than write an annotation ClusterD misreads.
    """
    intended = merge_faults(confirm, platform)
    text = format_faults(intended)
    back: LenientParse = parse_faults(text, strict=False)
    if (text and not CANONICAL.fullmatch(text)) or back.poisoned or back.dropped or back.rejected \
            or back.faults != intended:
        raise AssertionError(f"refusing to write non-canonical ProcessResultFault {text!r}")
    return intended, text
