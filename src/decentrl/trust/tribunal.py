"""The tribunal: how spot-checks become a ruling that trusts no single verifier, and no newcomer.

A verifier is a stranger like any producer: it could cover a partner's lie (report "passed") or
frame an honest replica (report "failed"). So one verifier's opinion is never the last word on a
failure, and identities are free, so the opinion of a peer on probation (trust/reputation.py) is
never a word at all:

- An opinion *stands* when every peer of its panel that shaped it is established (not on
  probation; admitted training peers are): the judges of the stages up to the one it found
  failing (every stage, for a pass), and whoever fed them. Only standing opinions are weighed,
  and only their judges and producers earn or lose a record from them.
- The first opinion comes from a panel drawn at random among the eligible verifiers of each stage
  (trust/verify.py `Verifier.panel`): never a peer that served the group, an established verifier
  wherever a stage has one. Every later panel is established throughout, or is not convened.
- A first opinion that does not stand is advisory. A pass from it verifies nothing: the check is
  skipped (the group trains as if never sampled, unless a peer on probation produced it, then it
  is dropped unchecked). A failure from it only asks for a standing opinion at that stage (its
  judge there may be asked again if established, fed by established peers this time); where
  none can be had, the group is dropped unconfirmed and nobody is charged.
- A failed standing opinion is repeated by a second standing panel whose verifier at the failing
  stage is another peer; a random `second_opinion_fraction` of passes is too (that is what
  catches a verifier covering its partner), and so is a pass that answered an advisory failure.
- Two standing opinions that agree decide. When they disagree, a third standing panel, with
  another verifier at the contested stage where the stage has one, decides by majority.
- Where the stage has nobody else to ask, an admitted training peer's opinion (`vouched`: the
  operator admitted it, and trusts it with the stage's gradients already) stands on its own: it
  confirms a failure alone, and it decides a disagreement with another established verifier.
  That is what judges a stage served by a single replica.
- The producer blamed by the upheld opinion is charged, only where the ruling is confirmed. A
  verifier whose opinion was overruled is charged at the stage where it parted from the upheld
  one, unless a peer on probation fed it (judged or re-executed an earlier stage of its panel:
  the difference may be the newcomer's doing); a verifier on probation only where two standing
  opinions or a vouched one upheld the other finding (one established verifier's word does not
  ban a newcomer). The verifiers of upheld opinions pass. A failure that no second standing
  verifier could confirm, or three opinions that all differ, charges nobody: the group is
  dropped all the same, since training on it is the one thing that cannot be undone.
- `Ruling.lacked_established` marks a check that an advisory opinion could not get weighed (no
  established verifier was left at its stage): the gate counts those (`verify_no_established`).

What this bounds: a lone hostile verifier can get a few honest groups dropped (it is overruled and
charged each time it tries to frame someone); a colluding pair is caught whenever the covering
verifier's pass is repeated and overruled, or whenever the liar is judged by anyone else; any
number of identities on probation can get groups dropped where no established verifier is left,
and can neither charge nor clear anyone."""

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
    confirmed: bool  # a failure that at least two standing opinions found (or a standing pass)
    overruled: tuple[Overruled, ...]  # verifiers charged for an opinion the ruling rejected
    upheld: tuple[tuple[str, int], ...]  # (verifier, stage) of opinions that agreed with it
    # An advisory opinion (a panel with a peer on probation) that no established verifier was
    # left to weigh: the check was skipped or its group dropped unconfirmed, never decided by it.
    lacked_established: bool = False


def finding(verdict: Verdict) -> Finding:
    return verdict.outcome, verdict.stage


def contested_stage(one: Verdict, other: Verdict) -> int:
    """The first stage two differing opinions disagree about."""
    stages = [v.stage for v in (one, other) if v.outcome == "failed" and v.stage is not None]
    return min(stages)


def stands(opinion: Verdict, on_probation: Callable[[str], bool]) -> bool:
    """Whether every peer that shaped `opinion` is established: its panel up to the stage it
    found failing (a later stage's verifier judged nothing), or all of it for a pass."""
    shaped = opinion.panel if opinion.stage is None else opinion.panel[:opinion.stage + 1]
    return not any(on_probation(peer) for peer in shaped)


def convene(verifier: Verifier, group: RolloutGroup, provenance: Provenance,
            repeat_pass: bool, vouched: Callable[[str], bool] = lambda peer: False) -> Ruling:
    """Rule on `group`: one opinion, a second where it failed (or `repeat_pass`), a third where
    the two differ; `vouched` peers stand alone where nobody else can be asked; peers on
    probation (as the verifier's directory knows them) advise and never decide."""
    on_probation = verifier.directory.on_probation
    first_panel = verifier.panel(provenance)
    if first_panel is None:
        return _skipped(group, "no replica to re-execute on")
    first = verifier.verify(group, provenance, first_panel)
    if first.outcome == "skipped" and first.panel:
        # A verifier that did not answer (gone, restarting) is replaced by a fresh draw once: in
        # a chaos run with every group checked, 15% of checks were lost to such draws.
        retry = verifier.panel(provenance, frozenset(first.panel))
        if retry is not None and retry != first_panel:
            first = verifier.verify(group, provenance, retry)
    if first.outcome == "skipped":
        return _ruling(first, [first], confirmed=False)
    opinions = [first]
    if not stands(first, on_probation):
        if first.outcome == "passed":
            return _skipped(group, "only a verifier on probation could re-execute it",
                            opinions, lacked_established=True)
        weighed = _another_opinion(verifier, group, provenance, opinions, first.stage)
        if weighed is None:
            return _undecided(first, opinions, "only a verifier on probation found it",
                              lacked_established=True)
        opinions.append(weighed)
        # An advisory failure is reason enough to repeat a pass: the newcomer may be right.
        return _decide(verifier, group, provenance, opinions, weighed, True, vouched,
                       on_probation)
    return _decide(verifier, group, provenance, opinions, first, repeat_pass, vouched,
                   on_probation)


def _decide(verifier: Verifier, group: RolloutGroup, provenance: Provenance,
            opinions: list[Verdict], first: Verdict, repeat_pass: bool,
            vouched: Callable[[str], bool], on_probation: Callable[[str], bool]) -> Ruling:
    """The ruling from `first`, the first standing opinion (after any advisory ones in
    `opinions`), and the standing opinions it calls for."""
    if first.outcome == "passed" and not repeat_pass:
        return _ruling(first, opinions, True, vouched, on_probation)
    contested = first.stage if first.outcome == "failed" else None
    second = _another_opinion(verifier, group, provenance, opinions, contested)
    if second is None:
        alone = contested is not None and vouched(first.panel[contested])
        return _ruling(first, opinions, first.outcome == "passed" or alone, vouched,
                       on_probation)
    opinions.append(second)
    if finding(second) == finding(first):
        return _ruling(first, opinions, True, vouched, on_probation)
    stage = contested_stage(first, second)
    third = _another_opinion(verifier, group, provenance, opinions, stage)
    standing = [first, second]
    if third is None:
        trusted = [o for o in standing if vouched(o.panel[stage])]
        if len(trusted) == 1:
            return _ruling(trusted[0], opinions, True, vouched, on_probation)
        return _undecided(first, opinions, "two verifiers disagree and no third could decide")
    opinions.append(third)
    standing.append(third)
    votes = Counter(finding(v) for v in standing)
    upheld, count = votes.most_common(1)[0]
    if count < 2:
        return _undecided(first, opinions, "three verifiers disagree")
    return _ruling(next(v for v in standing if finding(v) == upheld), opinions, True, vouched,
                   on_probation)


def _another_opinion(verifier: Verifier, group: RolloutGroup, provenance: Provenance,
                     opinions: list[Verdict], contested: int | None) -> Verdict | None:
    """A standing opinion from an established panel that avoids the verifiers of the earlier
    standing opinions (at the `contested` stage it must; an advisory opinion's established
    judge may be asked again, fed by established peers this time); None when there is no such
    panel or its re-execution failed."""
    on_probation = verifier.directory.on_probation
    avoid = frozenset(peer for opinion in opinions if stands(opinion, on_probation)
                      for peer in opinion.panel)
    panel = verifier.panel(provenance, avoid, contested, established_only=True)
    if panel is None:
        return None
    opinion = verifier.verify(group, provenance, panel)
    return None if opinion.outcome == "skipped" else opinion


def _ruling(upheld: Verdict, opinions: list[Verdict], confirmed: bool,
            vouched: Callable[[str], bool] = lambda peer: False,
            on_probation: Callable[[str], bool] = lambda peer: False) -> Ruling:
    """`upheld` (a standing opinion) is the ruling: who agreed with it earns, who parted from it
    is charged (a verifier on probation only where the upheld finding is corroborated)."""
    agreeing = [o for o in opinions if finding(o) == finding(upheld)
                and stands(o, on_probation)]
    overruled, agreed = [], []
    for opinion in opinions:
        if finding(opinion) == finding(upheld):
            agreed += [(opinion.panel[s], s) for s in opinion.checked]
            continue
        stage = contested_stage(opinion, upheld)
        judge = opinion.panel[stage]
        if stage not in opinion.checked or judge == upheld.panel[stage]:
            continue
        if any(on_probation(peer) for peer in opinion.panel[:stage]):
            continue  # a newcomer fed the judge: what it judged may be the newcomer's doing
        corroborated = len(agreeing) >= 2 or any(vouched(o.panel[stage]) for o in agreeing)
        if on_probation(judge) and not corroborated:
            continue  # one established verifier's word does not ban a newcomer
        why = ("reported a lie the tribunal did not find" if opinion.outcome == "failed"
               and opinion.stage == stage else "covered a lie the tribunal found")
        overruled.append(Overruled(judge, stage, f"as verifier of group {upheld.group_id}: "
                                                f"{why}"))
    if upheld.outcome == "failed" and not confirmed:
        agreed = []  # nothing confirmed: nobody earns from it
    return Ruling(upheld, tuple(opinions), confirmed, tuple(overruled), tuple(agreed))


def _skipped(group: RolloutGroup, why: str, opinions: list[Verdict] | None = None,
             lacked_established: bool = False) -> Ruling:
    """No opinion that could be weighed: nobody earns or is charged."""
    seconds = sum(o.seconds for o in opinions or [])
    skipped = Verdict(group.group_id, "skipped", None, None, why, (), seconds, ())
    return Ruling(skipped, tuple(opinions or [skipped]), False, (), (), lacked_established)


def _undecided(first: Verdict, opinions: list[Verdict], why: str,
               lacked_established: bool = False) -> Ruling:
    failed = next((v for v in opinions if v.outcome == "failed"), first)
    verdict = Verdict(first.group_id, "failed", failed.stage, failed.peer,
                      f"unconfirmed: {why}", (), sum(v.seconds for v in opinions), first.panel)
    return Ruling(verdict, tuple(opinions), False, (), (), lacked_established)
