"""The tribunal: how spot-checks become a ruling that trusts no single verifier.

A verifier is a stranger like any producer: it could cover a partner's lie (report "passed") or
frame an honest replica (report "failed"). So one verifier's opinion is never the last word on a
failure:

- The first opinion comes from a panel drawn at random among the eligible verifiers of each stage
  (trust/verify.py `Verifier.panel`): never a peer that served the group.
- A failed opinion is repeated by a second panel whose verifier at the failing stage is another
  peer; a random `second_opinion_fraction` of passed opinions is too (that is what catches a
  verifier covering its partner).
- Two opinions that agree decide. When they disagree, a third panel, with other verifiers at the
  contested stage where the stage has them, decides by majority.
- Where the stage has nobody else to ask, an admitted training peer's opinion (`vouched`: the
  operator admitted it, and trusts it with the stage's gradients already) stands on its own: it
  confirms a failure alone, and it decides a disagreement with a stranger. That is what judges a
  stage served by a single replica.
- The producer blamed by the upheld opinion is charged; so is every verifier whose opinion was
  overruled, at the stage where it parted from the upheld one; the verifiers of upheld opinions
  pass. A failure that no second verifier could confirm (the stage has nobody else), or three
  opinions that all differ, charges nobody: the group is dropped all the same, since training on
  it is the one thing that cannot be undone.

What this bounds: a lone hostile verifier can get a few honest groups dropped (it is overruled and
charged each time it tries to frame someone); a colluding pair is caught whenever the covering
verifier's pass is repeated and overruled, or whenever the liar is judged by anyone else."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from decentrl.rollout.types import RolloutGroup
from decentrl.trust.provenance import Provenance
from decentrl.trust.verify import Verdict, Verifier

# What an opinion says: passed, or which stage failed. Two opinions that fail the same stage agree
# even if they name different replicas (after a failover, their first failing columns may differ).
Finding = tuple[str, int | None]


@dataclass(frozen=True)
class Overruled:
    verifier: str
    stage: int
    why: str


@dataclass(frozen=True)
class Ruling:
    verdict: Verdict  # the upheld opinion; "skipped" when none could be formed
    opinions: tuple[Verdict, ...]
    confirmed: bool  # a failure that at least two opinions found (or a pass)
    overruled: tuple[Overruled, ...]  # verifiers charged for an opinion the ruling rejected
    upheld: tuple[tuple[str, int], ...]  # (verifier, stage) of opinions that agreed with it


def finding(verdict: Verdict) -> Finding:
    return verdict.outcome, verdict.stage


def contested_stage(one: Verdict, other: Verdict) -> int:
    """The first stage two differing opinions disagree about."""
    stages = [v.stage for v in (one, other) if v.outcome == "failed" and v.stage is not None]
    return min(stages)


def convene(verifier: Verifier, group: RolloutGroup, provenance: Provenance,
            repeat_pass: bool, vouched: Callable[[str], bool] = lambda peer: False) -> Ruling:
    """Rule on `group`: one opinion, a second where it failed (or `repeat_pass`), a third where
    the two differ; `vouched` peers stand alone where nobody else can be asked."""
    first_panel = verifier.panel(provenance)
    if first_panel is None:
        skipped = Verdict(group.group_id, "skipped", None, None, "no replica to re-execute on",
                          (), 0.0, ())
        return Ruling(skipped, (skipped,), False, (), ())
    first = verifier.verify(group, provenance, first_panel)
    if first.outcome == "skipped" and first.panel:
        # A verifier that did not answer (gone, restarting) is replaced by a fresh draw once: in
        # a chaos run with every group checked, 15% of checks were lost to such draws.
        retry = verifier.panel(provenance, frozenset(first.panel))
        if retry is not None and retry != first_panel:
            first = verifier.verify(group, provenance, retry)
    if first.outcome == "skipped" or (first.outcome == "passed" and not repeat_pass):
        return _ruling(first, [first], confirmed=first.outcome == "passed")
    opinions = [first]
    contested = first.stage if first.outcome == "failed" else None
    second = _another_opinion(verifier, group, provenance, opinions, contested)
    if second is None:
        alone = contested is not None and vouched(first.panel[contested])
        return _ruling(first, opinions, confirmed=first.outcome == "passed" or alone)
    opinions.append(second)
    if finding(second) == finding(first):
        return _ruling(first, opinions, confirmed=True)
    third = _another_opinion(verifier, group, provenance, opinions,
                             contested_stage(first, second))
    if third is None:
        stage = contested_stage(first, second)
        trusted = [o for o in opinions if vouched(o.panel[stage])]
        if len(trusted) == 1:
            return _ruling(trusted[0], opinions, confirmed=True)
        return _undecided(first, opinions, "two verifiers disagree and no third could decide")
    opinions.append(third)
    votes = Counter(finding(v) for v in opinions)
    upheld, count = votes.most_common(1)[0]
    if count < 2:
        return _undecided(first, opinions, "three verifiers disagree")
    return _ruling(next(v for v in opinions if finding(v) == upheld), opinions, confirmed=True)


def _another_opinion(verifier: Verifier, group: RolloutGroup, provenance: Provenance,
                     opinions: list[Verdict], contested: int | None) -> Verdict | None:
    """An opinion from a panel that avoids the earlier panels' verifiers (at the `contested`
    stage it must); None when there is no such panel or its re-execution failed."""
    avoid = frozenset(peer for opinion in opinions for peer in opinion.panel)
    panel = verifier.panel(provenance, avoid, contested)
    if panel is None:
        return None
    opinion = verifier.verify(group, provenance, panel)
    return None if opinion.outcome == "skipped" else opinion


def _ruling(upheld: Verdict, opinions: list[Verdict], confirmed: bool) -> Ruling:
    overruled, agreed = [], []
    for opinion in opinions:
        if finding(opinion) == finding(upheld):
            agreed += [(opinion.panel[s], s) for s in opinion.checked]
            continue
        stage = contested_stage(opinion, upheld)
        judge = opinion.panel[stage]
        if stage in opinion.checked and judge != upheld.panel[stage]:
            why = ("reported a lie the tribunal did not find" if opinion.outcome == "failed"
                   and opinion.stage == stage else "covered a lie the tribunal found")
            overruled.append(Overruled(judge, stage, f"as verifier of group {upheld.group_id}: "
                                                    f"{why}"))
    if upheld.outcome == "failed" and not confirmed:
        agreed = []  # nothing confirmed: nobody earns from it
    return Ruling(upheld, tuple(opinions), confirmed, tuple(overruled), tuple(agreed))


def _undecided(first: Verdict, opinions: list[Verdict], why: str) -> Ruling:
    failed = next((v for v in opinions if v.outcome == "failed"), first)
    verdict = Verdict(first.group_id, "failed", failed.stage, failed.peer,
                      f"unconfirmed: {why}", (), sum(v.seconds for v in opinions), first.panel)
    return Ruling(verdict, tuple(opinions), False, (), ())
