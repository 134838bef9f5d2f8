"""Find the smallest set of modules whose FP32 cast makes training pass (no subprocesses).

:func:`find_culprits` only needs ``test(S)``: run training with the modules in ``S`` forced
to FP32 and say ``pass``, ``fail``, ``error`` or ``timeout``. The search:

1. **Controls**: ``test(∅)`` must fail (else ``healthy``); forcing every top-level candidate
   must pass (else ``not_precision``). Results the caller already has go in ``known``.
2. **Hints** (e.g. the first layer that went non-finite in the baseline trace): if forcing
   the hint passes, check deeper: a leaf is then the answer (3 trials in all); for a
   container, forcing all of its children failing means its own forward does the damage
   (4 trials in all); otherwise search inside it.
3. **Prefix bisection over the leaves in execution order.** Forcing a container forces all
   of its leaves *and* its own ops, so the prefix sets are *covers*: a container whose
   leaves are all in the prefix is forced as a whole. When "pass iff the culprits are
   forced" is monotone, the smallest passing prefix ends at a culprit ``λ``: binary search
   finds it in ``ceil(log2 n)`` trials for ``n`` leaves, whatever the tree's shape. One trial
   then checks ``F ∪ {λ}`` (the deepest answer) and stops there for a single culprit:
   ``2 + ceil(log2 n) + 1`` trials in all. Otherwise it decides whether ``λ`` or a
   container that ``λ`` completed is needed (the container's own op), and the next round
   searches the leaves before ``λ`` with the found culprits forced: about
   ``d·(log2 n + 2)`` trials for ``d`` culprits.
4. **ddmin** over the leaves is the fallback when results are not monotone or some sets
   could not be decided.
5. **Confirmation**: the culprit set must pass, and dropping any one culprit must fail
   (a culprit whose removal passes is dropped: the result is always 1-minimal).

``error``/``timeout`` are neither pass nor fail (``git bisect skip``): binary search tries
other split points, then ddmin; a result that cannot be confirmed is ``inconclusive``,
never a guess. With ``repeat=R`` each set runs until one outcome has a majority of ``R``
(early stop); disagreeing runs are recorded as flaky. Every set is run at most once (per
repeat): results are cached.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Mapping, NamedTuple, Optional, Sequence

__all__ = ["Outcome", "Trial", "Disagreement", "SearchResult", "find_culprits"]

logger = logging.getLogger(__name__)

Outcome = Literal["pass", "fail", "error", "timeout"]
_OUTCOMES = ("pass", "fail", "error", "timeout")


class Trial(NamedTuple):
    fp32: frozenset[str]  # modules forced to FP32 (no module together with its ancestor)
    outcome: str  # Outcome


class Disagreement(NamedTuple):
    fp32: frozenset[str]
    outcomes: tuple[str, ...]  # every run of that set, in order
    decided: Optional[str]  # the majority ("pass"/"fail"), None when there was none


@dataclass
class SearchResult:
    verdict: str  # culprit | healthy | not_precision | inconclusive
    culprits: list[str] = field(default_factory=list)  # qualified names, execution order
    trials: list[Trial] = field(default_factory=list)  # in the order run (each repeat counts)
    disagreements: list[Disagreement] = field(default_factory=list)  # sets whose runs disagreed
    notes: list[str] = field(default_factory=list)  # what the search did that a person should know
    suspects: list[str] = field(default_factory=list)  # inconclusive: the smallest set seen to pass

    def to_dict(self) -> dict[str, Any]:
        """JSON-able; sets become sorted lists."""
        return {
            "verdict": self.verdict, "culprits": list(self.culprits), "suspects": list(self.suspects),
            "trials": [{"fp32": sorted(t.fp32), "outcome": t.outcome} for t in self.trials],
            "disagreements": [{"fp32": sorted(d.fp32), "outcomes": list(d.outcomes), "decided": d.decided}
                              for d in self.disagreements],
            "notes": list(self.notes),
        }


class _Undecided(Exception):
    """A fact the search needs could not be established (error/timeout/flaky results)."""


class _NonMonotone(Exception):
    """Results contradict "pass iff the culprits are forced"."""


class _Budget(Exception):
    pass


class _Tree:
    """The candidate module tree: execution order, parents, leaves, covers."""

    def __init__(self, candidates: Sequence[str], parent: Optional[Mapping[str, Optional[str]]]) -> None:
        self.order = {}
        for name in candidates:
            if name in self.order:
                raise ValueError(f"candidate {name!r} listed twice; pass each module name once")
            self.order[name] = len(self.order)
        if parent is None:
            parent = {n: self._infer_parent(n) for n in self.order}
        self.parent = {n: (p if p in self.order and p != n else None) for n, p in
                       ((n, parent.get(n)) for n in self.order)}
        self.children: dict[str, list[str]] = {n: [] for n in self.order}
        for n in self.order:
            if self.parent[n] is not None:
                self.children[self.parent[n]].append(n)
        self.ancestors = {n: self._walk_up(n) for n in self.order}
        self.top = [n for n in self.order if self.parent[n] is None]
        self.leaves_of: dict[str, list[str]] = {}
        for n in sorted(self.order, key=lambda n: -len(self.ancestors[n])):  # deepest first
            kids = self.children[n]
            self.leaves_of[n] = sorted({lf for k in kids for lf in self.leaves_of[k]}, key=self.order.get) \
                if kids else [n]
        self.leaves = [n for n in self.order if not self.children[n]]
        self.containers = [n for n in self.order if self.children[n]]

    def _infer_parent(self, name: str) -> Optional[str]:
        # Nearest candidate whose qualified name is a dotted prefix ("" is the root module).
        parts = name.split(".") if name else []
        for i in range(len(parts) - 1, -1, -1):
            p = ".".join(parts[:i])
            if p in self.order and p != name:
                return p
        return None

    def _walk_up(self, name: str) -> list[str]:
        out, p = [], self.parent[name]
        while p is not None:
            if p in out or p == name:
                raise ValueError(f"parent map has a cycle through {name!r}")
            out.append(p)
            p = self.parent[p]
        return out  # innermost first

    def sort(self, names: Iterable[str]) -> list[str]:
        return sorted(set(names), key=self.order.get)

    def normalize(self, names: Iterable[str]) -> frozenset:
        s = set(names)
        return frozenset(n for n in s if not any(a in s for a in self.ancestors[n]))

    def covered(self, names: Iterable[str]) -> set:
        return {lf for n in names for lf in self.leaves_of[n]}

    def cover(self, names: Iterable[str]) -> frozenset:
        """The set plus every container all of whose leaves it covers (forced as a whole)."""
        names = set(names)
        atoms = self.covered(names)
        names |= {c for c in self.containers if atoms.issuperset(self.leaves_of[c])}
        return self.normalize(names)


class _Search:
    def __init__(self, tree: _Tree, test: Callable[[frozenset], str], repeat: int,
                 known: Optional[Mapping[frozenset, str]], max_trials: Optional[int], spent: int = 0) -> None:
        self.tree, self.test, self.repeat, self.max_trials = tree, test, repeat, max_trials
        self.spent = spent  # trials run before the search, on its account (the results in ``known``)
        self.cache: dict[frozenset, Optional[str]] = {}
        self.raw: dict[frozenset, str] = {}
        self.first_runs: dict[frozenset, list[str]] = {}  # runs made before the search, not yet a majority of repeat
        for s, o in (known or {}).items():
            key = tree.normalize(s)
            if not isinstance(o, str):  # the runs so far: ``decide`` adds runs until one outcome has its majority
                self.first_runs[key] = list(o)
                continue
            self.raw[key] = o
            self.cache[key] = o if o in ("pass", "fail") else None
        self.trials: list[Trial] = []
        self.disagreements: list[Disagreement] = []
        self.notes: list[str] = []
        self.own_op: set[str] = set()  # containers shown to be needed themselves

    # -- running a set -------------------------------------------------------------------
    def decide(self, names: Iterable[str]) -> Optional[str]:
        """``pass``/``fail`` by majority of up to ``repeat`` runs, None when undecided."""
        s = self.tree.normalize(names)
        if s in self.cache:
            return self.cache[s]
        runs: list[str] = self.first_runs.pop(s, [])  # (counted in ``spent`` already)
        need = self.repeat // 2 + 1
        while len(runs) < self.repeat and max(runs.count("pass"), runs.count("fail")) < need:
            if self.max_trials is not None and self.spent + len(self.trials) >= self.max_trials:
                raise _Budget()
            o = self.test(s)
            if o not in _OUTCOMES:
                raise ValueError(f"test() returned {o!r} for {sorted(s)}; return one of {_OUTCOMES}")
            runs.append(o)
            self.trials.append(Trial(s, o))
            left = self.repeat - len(runs)
            if max(runs.count("pass"), runs.count("fail")) >= need:
                break
            if max(runs.count("pass"), runs.count("fail")) + left < need:
                break
        decided = next((v for v in ("pass", "fail") if runs.count(v) >= need), None)
        if len(set(runs)) > 1:
            self.disagreements.append(Disagreement(s, tuple(runs), decided))
            logger.info("trial %s disagreed across runs: %s", sorted(s), runs)
        self.cache[s], self.raw[s] = decided, (decided or runs[-1])
        return decided

    # -- the search ------------------------------------------------------------------------
    def prefix_search(self, leaves: list[str], ctx: Iterable[str] = ()) -> list[str]:
        t = self.tree
        ctx, found, rest = list(ctx), [], list(leaves)
        while True:
            if not rest:
                raise _NonMonotone("every candidate is forced yet the found set still fails")
            hi = self._bisect(ctx + found, rest)
            lam, before = rest[hi - 1], rest[:hi - 1]
            if self.decide(ctx + found + [lam]) == "pass":  # optimistic: the deepest answer
                return found + [lam]
            node = self._resolve(ctx + found, before, lam)
            found.append(node)
            rest = [u for u in before if u not in set(t.leaves_of[node])]
            r = self.decide(ctx + found)
            if r == "pass":
                return found
            if r is None:
                raise _Undecided(f"could not decide {sorted(ctx + found)}")

    def _bisect(self, base: list[str], rest: list[str]) -> int:
        """Smallest k with cover(base + rest[:k]) passing; base alone fails, all of rest passes."""
        lo, hi, skipped = 0, len(rest), set()
        while hi - lo > 1:
            mid = (lo + hi) // 2
            choices = [k for k in range(lo + 1, hi) if k not in skipped]
            if not choices:
                raise _Undecided(f"prefixes {lo + 1}..{hi - 1} of {rest[lo:hi]} could not be decided")
            k = min(choices, key=lambda k: (abs(k - mid), k))
            r = self.decide(self.tree.cover(base + rest[:k]))
            if r == "pass":
                hi = k
            elif r == "fail":
                lo = k
            else:
                skipped.add(k)
        return hi

    def _resolve(self, base: list[str], before: list[str], lam: str) -> str:
        """``lam`` ended the smallest passing prefix: is it needed itself, or the own op of a
        container it completed? (Innermost container that suffices.)"""
        t = self.tree
        atoms = t.covered(base + before + [lam])
        completed = [a for a in t.ancestors[lam] if atoms.issuperset(t.leaves_of[a])]
        if not completed:
            return lam
        prefix = t.cover(base + before)
        for node in [lam] + completed[:-1]:
            r = self.decide(set(prefix) | {node})
            if r == "pass":
                break
            if r is None:
                raise _Undecided(f"could not decide {sorted(set(prefix) | {node})}")
        else:
            node = completed[-1]
        if node != lam:  # its child on the path to lam, with everything before it, failed
            self.own_op.add(node)
        return node

    def ddmin(self, leaves: list[str]) -> list[str]:
        """Zeller's ddmin over leaves (covers): a 1-minimal passing subset; undecided = not pass."""
        cur, n = list(leaves), 2
        while len(cur) >= 2:
            size = -(-len(cur) // n)
            chunks = [cur[i:i + size] for i in range(0, len(cur), size)]
            reduced = False
            for ch in chunks:
                if self.decide(self.tree.cover(ch)) == "pass":
                    cur, n, reduced = ch, 2, True
                    break
            if not reduced and len(chunks) > 2:
                for ch in chunks:
                    comp = [x for x in cur if x not in ch]
                    if self.decide(self.tree.cover(comp)) == "pass":
                        cur, n, reduced = comp, max(n - 1, 2), True
                        break
            if not reduced:
                if n >= len(cur):
                    break
                n = min(2 * n, len(cur))
        return self.tree.sort(self.tree.cover(cur))

    def try_hints(self, hints: Sequence[str]) -> Optional[list[str]]:
        t = self.tree
        for h in dict.fromkeys(hints):
            if h not in t.order:
                self.notes.append(f"hint {h!r} is not a candidate; ignored")
                continue
            if self.decide([h]) != "pass":
                continue
            if not t.children[h]:
                return [h]
            r = self.decide(t.children[h])
            if r == "fail":
                self.own_op.add(h)
                return [h]
            if r == "pass":
                try:
                    return self.prefix_search(t.leaves_of[h])
                except (_Undecided, _NonMonotone) as e:
                    self.notes.append(f"search inside hint {h!r} could not settle ({e})")
                    return None
        return None

    def confirm(self, nodes: list[str]) -> tuple[list[str], list[str]]:
        """Reduce to a 1-minimal passing set; returns (culprits, unconfirmed)."""
        t = self.tree
        nodes = t.sort(nodes)
        r = self.decide(nodes)
        if r != "pass":
            raise (_NonMonotone if r == "fail" else _Undecided)(f"{nodes} does not pass on its own")
        while True:
            unconfirmed = []
            for c in nodes:
                r = self.decide([x for x in nodes if x != c])
                if r == "pass":
                    self.notes.append(f"dropped {c!r}: not needed once the others are forced")
                    nodes = [x for x in nodes if x != c]
                    break
                if r is None:
                    unconfirmed.append(c)
            else:
                break
        for c in [n for n in nodes if t.children[n] and n not in self.own_op]:
            # Found by ddmin or a hint: would its children do instead?
            rest = [x for x in nodes if x != c]
            if self.decide(rest + t.children[c]) == "pass":
                try:
                    deeper = self.prefix_search(t.leaves_of[c], ctx=rest)
                except (_Undecided, _NonMonotone):
                    self.notes.append(f"could not tell whether a module inside {c!r} suffices")
                    continue
                return self.confirm(rest + deeper)
        return nodes, unconfirmed

    def smallest_passing(self) -> list[str]:
        passing = [s for s, o in self.cache.items() if o == "pass"]
        return self.tree.sort(min(passing, key=len)) if passing else []


def find_culprits(candidates: Sequence[str], test: Callable[[frozenset[str]], Outcome], *,
                  parent: Optional[Mapping[str, Optional[str]]] = None, hints: Sequence[str] = (),
                  repeat: int = 1, known: Optional[Mapping[frozenset[str], Outcome | Sequence[Outcome]]] = None,
                  max_trials: Optional[int] = None, spent: int = 0) -> SearchResult:
    """Search ``candidates`` (qualified module names in execution order, containers and
    leaves) for the smallest set, of the deepest modules, whose FP32 cast makes ``test`` pass.

    ``parent`` maps each candidate to its parent candidate or None; by default it is inferred
    from dotted names (pass ``{n: None for n in candidates}`` for a flat search). ``hints``
    are tried first. ``known`` holds results already run (e.g. the controls), keyed by
    frozenset of names: a decided outcome, or the list of the runs so far, which ``repeat`` goes on
    from (the first guesses run side by side with ``--jobs``). ``max_trials`` bounds the number of runs (inconclusive beyond it), ``spent``
    of which were run already (those in ``known`` that count as search trials).
    """
    if repeat < 1:
        raise ValueError(f"repeat={repeat}: must be >= 1 (runs per trial set, majority decides)")
    tree = _Tree(candidates, parent)
    s = _Search(tree, test, repeat, known, max_trials, spent)

    def result(verdict: str, culprits: Sequence[str] = (), suspects: Sequence[str] = ()) -> SearchResult:
        if verdict == "inconclusive" and s.disagreements:
            s.notes.append("runs disagreed on: " + "; ".join(
                f"{sorted(d.fp32)} -> {list(d.outcomes)}" for d in s.disagreements))
        return SearchResult(verdict, tree.sort(culprits), list(s.trials), list(s.disagreements),
                            list(s.notes), tree.sort(suspects))

    try:
        for names, label, bad in (([], "baseline (nothing forced)", "pass"),
                                  (tree.top, "control (all top-level modules forced)", "fail")):
            r = s.decide(names)
            if r is None:
                s.notes.append(f"the {label} was {s.raw[tree.normalize(names)]}: cannot bisect")
                return result("inconclusive")
            if r == bad:
                return result("healthy" if bad == "pass" else "not_precision")
        nodes = None
        try:
            nodes = s.try_hints(hints)
            if nodes is None:
                nodes = s.prefix_search(tree.leaves)
            nodes, unconfirmed = s.confirm(nodes)
        except (_Undecided, _NonMonotone) as e:
            s.notes.append(f"bisection could not settle ({e}); falling back to ddmin")
            logger.info("bisect: falling back to ddmin: %s", e)
            try:
                nodes, unconfirmed = s.confirm(s.ddmin(tree.leaves))
            except (_Undecided, _NonMonotone) as e2:
                s.notes.append(f"ddmin could not settle either ({e2})")
                return result("inconclusive", suspects=s.smallest_passing())
        if unconfirmed:
            s.notes.append(f"could not confirm that {unconfirmed} are needed (undecided trials)")
            return result("inconclusive", suspects=nodes)
        return result("culprit", nodes)
    except _Budget:
        s.notes.append(f"trial budget of {max_trials} exhausted")
        return result("inconclusive", suspects=s.smallest_passing())
