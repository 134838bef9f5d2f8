"""The culprit search on synthetic test functions: exact trial counts, robustness, minimality."""

from __future__ import annotations

import math
import random
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ampdoctor.bisect.search import find_culprits


def flat(n: int) -> tuple[list[str], dict]:
    names = [f"l{i}" for i in range(n)]
    return names, {x: None for x in names}


def blocks(sizes: list[int]) -> tuple[list[str], dict]:
    """Execution order the way named_modules() lists it: a block, then its children."""
    names, parent = [], {}
    for b, size in enumerate(sizes):
        names.append(f"b{b}")
        parent[f"b{b}"] = None
        for i in range(size):
            names.append(f"b{b}.l{i}")
            parent[f"b{b}.l{i}"] = f"b{b}"
    return names, parent


def ancestors(parent: dict, x: str) -> list[str]:
    out = []
    while parent.get(x) is not None:
        x = parent[x]
        out.append(x)
    return out


def truth(parent: dict, culprits: set[str]):
    """Monotone ground truth: pass iff every culprit is forced, itself or through an ancestor."""
    def test(s: frozenset) -> str:
        return "pass" if all(c in s or any(a in s for a in ancestors(parent, c)) for c in culprits) else "fail"
    return test


def counted(test):
    calls: list[frozenset] = []

    def wrapper(s):
        assert s not in calls, f"set {sorted(s)} ran twice"
        calls.append(s)
        return test(s)
    wrapper.calls = calls
    return wrapper


def bound(n: int) -> int:
    return 2 + math.ceil(math.log2(n)) + 1


@pytest.mark.parametrize("n", [8, 13, 16, 32, 50, 64])
def test_single_leaf_flat_every_position(n):
    names, parent = flat(n)
    worst = 0
    for c in names:
        t = counted(truth(parent, {c}))
        r = find_culprits(names, t, parent=parent)
        assert r.verdict == "culprit" and r.culprits == [c]
        assert len(r.trials) == len(t.calls)
        worst = max(worst, len(r.trials))
    assert worst <= bound(n)


@pytest.mark.parametrize("sizes", [[4, 4], [8] * 8, [4] * 16, [16] * 4, [5, 3, 7, 1, 9], [3] * 5, [2, 30, 1]])
def test_single_leaf_two_levels_every_position(sizes):
    names, parent = blocks(sizes)
    leaves = [x for x in names if "." in x]
    for c in leaves:
        r = find_culprits(names, counted(truth(parent, {c})), parent=parent)
        assert r.verdict == "culprit" and r.culprits == [c]
        assert len(r.trials) <= bound(len(leaves)), (c, r.trials)


def test_exact_counts_8x8():
    names, parent = blocks([8] * 8)
    counts = {len(find_culprits(names, truth(parent, {c}), parent=parent).trials)
              for c in names if "." in c}
    # 2 controls + log2(64) + 1 check of the leaf alone (8 when that set was a prefix already)
    assert counts == {8, 9}


def test_parent_inferred_from_dotted_names():
    names, parent = blocks([4, 4, 4])
    r = find_culprits(names, truth(parent, {"b1.l2"}))
    assert r.culprits == ["b1.l2"] and len(r.trials) <= bound(12)


@pytest.mark.parametrize("hint_is", ["leaf", "container_own_op"])
def test_correct_hint_costs_at_most_4(hint_is):
    names, parent = blocks([8] * 8)
    culprit = "b5.l3" if hint_is == "leaf" else "b5"
    r = find_culprits(names, truth(parent, {culprit}), parent=parent, hints=[culprit])
    assert r.verdict == "culprit" and r.culprits == [culprit]
    assert len(r.trials) == (3 if hint_is == "leaf" else 4)


def test_wrong_hint_costs_one_more():
    names, parent = blocks([8] * 8)
    r = find_culprits(names, truth(parent, {"b2.l6"}), parent=parent, hints=["b7.l1", "nope"])
    assert r.culprits == ["b2.l6"] and len(r.trials) <= bound(64) + 1
    assert any("'nope' is not a candidate" in n for n in r.notes)


def test_hint_container_search_inside():
    names, parent = blocks([8] * 8)
    r = find_culprits(names, truth(parent, {"b3.l5"}), parent=parent, hints=["b3"])
    assert r.culprits == ["b3.l5"] and len(r.trials) <= 2 + 2 + 3 + 1


@pytest.mark.parametrize("pair", [("b1.l2", "b6.l0"), ("b4.l1", "b4.l6"), ("b0.l0", "b7.l7")])
def test_two_culprits_both_needed(pair):
    names, parent = blocks([8] * 8)
    t = counted(truth(parent, set(pair)))
    r = find_culprits(names, t, parent=parent)
    assert r.verdict == "culprit" and r.culprits == list(pair)
    # verified by the search itself: the pair passed, each one alone failed
    ran = {tr.fp32: tr.outcome for tr in r.trials}
    assert ran[frozenset(pair)] == "pass"
    assert ran[frozenset({pair[0]})] == ran[frozenset({pair[1]})] == "fail"
    assert len(r.trials) <= 2 * (bound(64) + 2)


def test_container_culprit_whose_children_do_not_suffice():
    names, parent = blocks([8] * 8)
    r = find_culprits(names, truth(parent, {"b2"}), parent=parent)
    assert r.verdict == "culprit" and r.culprits == ["b2"]
    assert len(r.trials) <= bound(64) + 2
    # forcing every child of b2 (with everything before it) was seen failing
    assert any(t.outcome == "fail" and {f"b2.l{i}" for i in range(8)} <= t.fp32 for t in r.trials)


def test_three_level_tree_container_in_middle():
    names = ["enc", "enc.0", "enc.0.attn", "enc.0.mlp", "enc.1", "enc.1.attn", "enc.1.mlp", "head"]
    parent = {"enc": None, "enc.0": "enc", "enc.0.attn": "enc.0", "enc.0.mlp": "enc.0", "enc.1": "enc",
              "enc.1.attn": "enc.1", "enc.1.mlp": "enc.1", "head": None}
    for c in names:
        r = find_culprits(names, truth(parent, {c}), parent=parent)
        assert r.verdict == "culprit" and r.culprits == [c], (c, r.trials)


def test_healthy_and_not_precision():
    names, parent = blocks([4, 4])
    r = find_culprits(names, lambda s: "pass", parent=parent)
    assert r.verdict == "healthy" and len(r.trials) == 1
    r = find_culprits(names, lambda s: "fail", parent=parent)
    assert r.verdict == "not_precision" and len(r.trials) == 2
    assert r.trials[1].fp32 == frozenset({"b0", "b1"})


def test_known_controls_are_not_rerun():
    names, parent = blocks([8] * 8)
    known = {frozenset(): "fail", frozenset(f"b{i}" for i in range(8)): "pass"}
    r = find_culprits(names, counted(truth(parent, {"b3.l3"})), parent=parent, known=known)
    assert r.culprits == ["b3.l3"] and len(r.trials) == 7


def test_baseline_error_is_inconclusive():
    r = find_culprits(["a", "b"], lambda s: "error" if not s else "pass")
    assert r.verdict == "inconclusive" and "baseline" in r.notes[0] and "error" in r.notes[0]


def _hash01(s: frozenset, salt: int) -> float:
    return zlib.crc32(("|".join(sorted(s)) + str(salt)).encode()) / 2 ** 32


@pytest.mark.parametrize("salt", range(12))
def test_errors_never_give_a_wrong_culprit(salt):
    names, parent = blocks([4] * 8)
    rng = random.Random(salt)
    culprit = rng.choice([x for x in names if "." in x])
    base = truth(parent, {culprit})
    control = frozenset(f"b{i}" for i in range(8))

    def test(s):
        if s and s != control and _hash01(s, salt) < 0.3:
            return rng.choice(["error", "timeout"])
        return base(s)
    r = find_culprits(names, test, parent=parent)
    assert r.verdict in ("culprit", "inconclusive")
    if r.verdict == "culprit":
        assert r.culprits == [culprit]
    assert r.verdict == "culprit" or r.suspects


def test_undecidable_boundary_is_inconclusive():
    names, parent = flat(8)
    base = truth(parent, {"l5"})
    r = find_culprits(names, lambda s: "error" if "l5" in s and len(s) < 8 else base(s), parent=parent)
    assert r.verdict == "inconclusive" and r.culprits == []


def test_flaky_majority_with_repeat_3():
    names, parent = blocks([8] * 8)
    base = truth(parent, {"b6.l2"})
    seen: dict[frozenset, int] = {}

    def flaky(s):  # the first run of every other set says the opposite
        seen[s] = seen.get(s, 0) + 1
        out = base(s)
        if seen[s] == 1 and _hash01(s, 0) < 0.5:
            return "pass" if out == "fail" else "fail"
        return out
    r = find_culprits(names, flaky, parent=parent, repeat=3)
    assert r.verdict == "culprit" and r.culprits == ["b6.l2"]
    assert r.disagreements and all(d.decided == base(d.fp32) for d in r.disagreements)


def test_runs_made_before_the_search_count_towards_repeat_not_for_it():
    # the first guesses ran side by side (--jobs 2) once each, and went in as decided: with --repeat 3 a
    # flaky single pass of the hint was accepted as the culprit without a majority
    names, parent = flat(8)
    base = truth(parent, {"l5"})
    hint = frozenset({"l2"})
    calls: list[frozenset] = []

    def test(s):
        calls.append(s)
        return base(s)
    known = {frozenset(): "fail", frozenset(names): ["pass"], hint: ["pass"]}  # the hint's one run: a fluke
    r = find_culprits(names, test, parent=parent, hints=["l2"], repeat=3, known=known, spent=2)
    assert r.verdict == "culprit" and r.culprits == ["l5"]
    assert calls.count(frozenset(names)) == 1  # the control: one more run makes its majority of 3
    assert calls.count(hint) == 2  # two more, both fail: 2 of 3
    assert any(d.fp32 == hint and d.outcomes == ("pass", "fail", "fail") and d.decided == "fail"
               for d in r.disagreements)
    calls.clear()
    find_culprits(names, test, parent=parent, hints=["l5"], repeat=1,
                  known={frozenset(): "fail", frozenset(names): ["pass"], frozenset({"l5"}): ["error"]}, spent=2)
    assert frozenset({"l5"}) not in calls and frozenset(names) not in calls  # repeat 1: one run was all of it


def test_unresolvable_flakiness_is_inconclusive_and_names_trials():
    names, parent = flat(8)
    base = truth(parent, {"l3"})
    seen: dict[frozenset, int] = {}

    def flaky(s):
        seen[s] = seen.get(s, 0) + 1
        if s == frozenset({"l3"}):
            return ["pass", "fail", "error"][seen[s] - 1]
        return base(s)
    r = find_culprits(names, flaky, parent=parent, repeat=3)
    assert r.verdict == "inconclusive" and "l3" in r.suspects
    assert any("['l3'] -> ['pass', 'fail', 'error']" in n for n in r.notes)


def test_max_trials():
    names, parent = flat(64)
    r = find_culprits(names, truth(parent, {"l40"}), parent=parent, max_trials=4)
    assert r.verdict == "inconclusive" and len(r.trials) == 4 and "budget" in r.notes[-1]


def test_non_monotone_falls_back_and_stays_minimal():
    names, parent = flat(8)

    def test(s):  # l2 and l6 together pass, but forcing l4 as well breaks it unless l7 is forced too
        ok = {"l2", "l6"} <= s and ("l4" not in s or "l7" in s)
        return "pass" if ok else "fail"
    r = find_culprits(names, test, parent=parent)
    assert r.verdict == "culprit" and set(r.culprits) == {"l2", "l6"}


# -- properties over random trees --------------------------------------------------------------
@st.composite
def trees(draw):
    names, parent = [], {}

    def grow(prefix, depth, par):
        for i in range(draw(st.integers(1, 4 if depth else 6))):
            name = f"{prefix}{i}"
            names.append(name)
            parent[name] = par
            if depth < 2 and draw(st.booleans()):
                grow(name + ".", depth + 1, name)
    grow("m", 0, None)
    k = draw(st.integers(1, 3))
    culprits = set(draw(st.lists(st.sampled_from(names), min_size=k, max_size=k)))
    return names, parent, culprits


def _minimal_deepest(parent, culprits):
    return {c for c in culprits if not any(a in culprits for a in ancestors(parent, c))}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees(), st.booleans())
def test_random_trees_sufficient_minimal_exact(tree, use_hint):
    names, parent, culprits = tree
    t = counted(truth(parent, culprits))
    hints = [sorted(culprits)[0]] if use_hint else []
    r = find_culprits(names, t, parent=parent, hints=hints)
    assert r.verdict == "culprit"
    found = frozenset(r.culprits)
    assert truth(parent, culprits)(found) == "pass"
    for c in found:
        assert truth(parent, culprits)(found - {c}) == "fail"
    assert found == _minimal_deepest(parent, culprits)
    assert r.culprits == [n for n in names if n in found]


@settings(max_examples=200, deadline=None)
@given(trees(), st.integers(0, 10 ** 6), st.floats(0.05, 0.5))
def test_random_trees_with_errors(tree, salt, p_err):
    names, parent, culprits = tree
    base = truth(parent, culprits)
    top = frozenset(n for n in names if parent[n] is None)

    def test(s):
        if s and s != top and _hash01(s, salt) < p_err:
            return "error"
        return base(s)
    r = find_culprits(names, test, parent=parent)
    assert r.verdict in ("culprit", "inconclusive")
    if r.verdict == "culprit":
        found = frozenset(r.culprits)
        assert base(found) == "pass" and all(base(found - {c}) == "fail" for c in found)
        # never a wrong culprit: each one is, or contains, a planted culprit
        assert all(any(c == x or c in ancestors(parent, x) for x in culprits) for c in found)


@settings(max_examples=150, deadline=None)
@given(trees(), st.integers(0, 10 ** 6))
def test_random_non_monotone_results_are_sufficient_and_1_minimal(tree, salt):
    names, parent, _ = tree
    top = frozenset(n for n in names if parent[n] is None)

    def test(s):
        if not s:
            return "fail"
        return "pass" if s == top or _hash01(s, salt) < 0.4 else "fail"
    r = find_culprits(names, test, parent=parent)
    assert r.verdict == "culprit"
    found = frozenset(r.culprits)
    assert test(found) == "pass" and all(test(found - {c}) == "fail" for c in found)
