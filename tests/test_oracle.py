"""The oracle on synthetic timelines (a simulated GradScaler, losses, parameter checks)."""

from __future__ import annotations

import math

import pytest

from ampdoctor.oracle import Decision, Oracle, OracleConfig

NAN = float("nan")


def scaler_timeline(overflow_steps, n, init=65536.0, growth_interval=2000):
    """(step, scale after update, skipped) the way torch.amp.GradScaler behaves."""
    scale, good, out = init, 0, []
    for step in range(n):
        skipped = step in overflow_steps
        if skipped:
            scale, good = scale * 0.5, 0
        else:
            good += 1
            if good == growth_interval:
                scale, good = scale * 2.0, 0
        out.append((step, scale, skipped))
    return out


def run(oracle, timeline, losses=None):
    for step, scale, skipped in timeline:
        loss = losses[step] if losses is not None else 1.0
        d = oracle.observe(step, loss, scale, skipped, True)
        if d is not None:
            return d
    return oracle.finish()


@pytest.mark.parametrize("warmup_skips", [3, 4, 5, 12])
def test_healthy_warmup_is_not_a_failure(warmup_skips):
    tl = scaler_timeline(set(range(warmup_skips)) | {200, 900}, 1000, growth_interval=100)
    assert run(Oracle(OracleConfig()), tl) == Decision("pass", 999, None)


def test_persistent_skipping_fails_at_first_skip_of_window():
    # Healthy warm-up, then from step 50 every step overflows, but the scale stays above 1
    # for a while: the skip window trips first.
    tl = scaler_timeline(set(range(4)) | set(range(50, 100)), 100)
    assert run(Oracle(), tl) == Decision("fail", 50, "skipped_steps")


def test_intermittent_skipping_below_half_passes():
    # One overflow in three steps, the scaler re-growing in between: a steady state, not a failure.
    tl = scaler_timeline(set(range(4)) | set(range(20, 200, 3)), 200, growth_interval=2)
    assert run(Oracle(), tl).outcome == "pass"


def test_alternating_skips_above_half_fail():
    overflow = set(range(4)) | {s for s in range(30, 100) if s % 4 != 0}  # 3 of every 4
    tl = scaler_timeline(overflow, 100, init=2.0 ** 60)
    d = run(Oracle(), tl)
    assert d.outcome == "fail" and d.reason == "skipped_steps"
    assert d.step == 30  # first skipped step inside the failing window


def test_scale_collapse_reports_start_of_backoff_run():
    cfg = OracleConfig(skip_window=10_000)  # isolate the collapse criterion
    tl = scaler_timeline(set(range(4)) | set(range(40, 100)), 100)
    d = run(Oracle(cfg), tl)
    # After warm-up the scale is 4096 = 2**12; 13 more halvings fall below 1.
    assert d == Decision("fail", 40, "scale_collapse")


def test_warmup_that_never_ends_fails():
    tl = scaler_timeline(set(range(100)), 100)
    d = run(Oracle(OracleConfig(scale_floor=0.0)), tl)
    assert d == Decision("fail", 0, "skipped_steps")
    d = run(Oracle(), tl)
    assert d == Decision("fail", 0, "scale_collapse")  # 65536 / 2**17 < 1 first


def test_long_backoff_from_a_huge_init_scale_is_start_up():
    """init_scale=2**40 on a healthy model: 24 skips in a row from step 0 while the scale halves to 2**16,
    then training. More than startup_grace skips: it was called a failure (skipped_steps at 0)."""
    tl = scaler_timeline(set(range(24)) | {300}, 400, init=2.0 ** 40, growth_interval=100)
    o = Oracle()
    assert [o.observe(s, 1.0, sc, sk, True) for s, sc, sk in tl] == [None] * 400
    assert o.finish() == Decision("pass", 399, None)
    # after it, skips that resume and persist are a failure as ever, where they began
    tl = scaler_timeline(set(range(24)) | set(range(60, 100)), 100, init=2.0 ** 40)
    assert run(Oracle(), tl) == Decision("fail", 60, "skipped_steps")


def test_long_start_up_skips_whose_scale_does_not_fall_fail():
    """Only a scale that halves at every skip is a backoff: a skip run with the scale held (or not seen)
    fails once it is longer than startup_grace, at its first step, as soon as that is known."""
    held = [(s, 2.0 ** 30, True) for s in range(30)]
    o = Oracle()
    got = [o.observe(s, 1.0, sc, sk, True) for s, sc, sk in held]
    assert got[:20] == [None] * 20 and got[20] == Decision("fail", 0, "skipped_steps")
    o = Oracle()
    got = [o.observe(s, 1.0, None, True, True) for s in range(30)]
    assert got[20] == Decision("fail", 0, "skipped_steps")
    # one skip whose scale did not fall, among halving ones
    tl = [(s, 2.0 ** (39 - s) if s != 5 else 2.0 ** 35, True) for s in range(30)]
    assert run(Oracle(), tl) == Decision("fail", 0, "skipped_steps")


def test_long_backoff_that_never_ends_fails_when_the_run_is_decided():
    """Still backing off (no step taken) when the run ends or a trial passes its pass_after: it never
    trained, a failure from its first step; within startup_grace skips it is not."""
    tl = scaler_timeline(set(range(30)), 30, init=2.0 ** 60)
    o = Oracle()
    assert [o.observe(s, 1.0, sc, sk, True) for s, sc, sk in tl] == [None] * 30
    assert o.finish() == Decision("fail", 0, "skipped_steps")
    tl = scaler_timeline(set(range(20)), 20, init=2.0 ** 60)
    assert run(Oracle(), tl).outcome == "pass"


def _skipping(n, grads, losses=None, taken=()):
    """``n`` steps of a GradScaler that skips all but ``taken``; ``grads[i]``: what step i's recorded
    gradients held (None: not recorded)."""
    o = Oracle()
    for step, scale, skipped in scaler_timeline(set(range(n)) - set(taken), n):
        loss = 1.0 if losses is None else losses[step]
        assert o.observe(step, loss, scale, skipped, True, grads[step]) is None
    return o.finish()


def test_every_step_skipped_with_nan_only_gradients_fails_when_the_run_ends():
    """GPT-2's fp16 NewGELU: x ** 3 overflows inside the forward, the backward makes NaN (inf * 0) at any
    scale; an 8-step run skipped every step, and was judged healthy: start-up backoffs (up to 20)."""
    assert _skipping(8, ["nan"] * 8) == Decision("fail", 0, "skipped_steps")
    # a search trial records step 0 only
    assert _skipping(6, ["nan"] + [None] * 5) == Decision("fail", 0, "skipped_steps")
    assert _skipping(4, ["nan", "finite", None, "nan"]) == Decision("fail", 0, "skipped_steps")


@pytest.mark.parametrize("n,grads,losses,taken", [
    (8, ["inf"] + ["nan"] * 7, None, ()),            # an Inf: the scale overflowed too
    (8, ["nan"] * 7 + ["inf"], None, ()),
    (3, ["nan"] * 3, None, ()),                      # fewer than NAN_SKIPS
    (8, ["nan"] * 8, None, (7,)),                    # a step was taken: the backoffs ended
    (8, [None] * 8, None, ()),                       # nothing recorded
    (8, ["finite"] * 8, None, ()),
    (8, ["nan"] * 8, [1.0, NAN] + [1.0] * 6, ()),    # a non-finite loss: not this rule's
])
def test_skips_that_are_not_nan_only_stay_start_up_backoffs(n, grads, losses, taken):
    assert _skipping(n, grads, losses, taken).outcome == "pass"


def test_grads_observation_is_checked():
    with pytest.raises(ValueError, match="grads="):
        Oracle().observe(0, 1.0, 1.0, False, True, "NaN")


def test_nan_streak_shorter_than_k_passes():
    losses = [1.0] * 30
    losses[10] = losses[11] = NAN
    losses[20] = math.inf
    o = Oracle(OracleConfig(nonfinite_k=3))
    for s, loss in enumerate(losses):
        assert o.observe(s, loss, None, None, None) is None
    assert o.finish() == Decision("pass", 29, None)


def test_nan_streak_of_k_fails_at_first_nan():
    losses = [1.0] * 10 + [NAN] * 5
    o = Oracle(OracleConfig(nonfinite_k=3))
    decisions = [o.observe(s, loss) for s, loss in enumerate(losses)]
    assert decisions[:12] == [None] * 12
    assert decisions[12] == Decision("fail", 10, "nonfinite_loss")
    assert decisions[13] is decisions[12]  # stays decided
    assert o.finish() == decisions[12]


def test_unobserved_loss_neither_extends_nor_breaks_streak():
    o = Oracle(OracleConfig(nonfinite_k=2))
    assert o.observe(0, NAN) is None
    assert o.observe(1, None) is None
    assert o.observe(2, NAN) == Decision("fail", 0, "nonfinite_loss")


def test_nonfinite_params_fail_at_once():
    o = Oracle()
    assert o.observe(0, 1.0, 65536.0, False, True) is None
    assert o.observe(1, 1.0, 65536.0, False, False) == Decision("fail", 1, "nonfinite_params")


def test_nonfinite_params_seen_late_are_reported_where_the_loss_broke():
    """Parameters observed only on some steps (as a search trial did before it checked them at every
    step: step 0, and the steps after a non-finite loss): SGD wrote NaN into them at step 5, whose loss
    was Inf; the trial saw them at 6 and said nonfinite_params at 6 where the baseline, checking every
    step, said 5."""
    o = Oracle()
    assert o.observe(0, 1.0, None, None, True) is None
    assert [o.observe(s, 1.0) for s in range(1, 5)] == [None] * 4
    assert o.observe(5, math.inf) is None
    assert o.observe(6, NAN, None, None, False) == Decision("fail", 5, "nonfinite_params")
    # the backward overflowed at 5 with a finite loss: the first sign a trial has is the loss at 6
    o = Oracle()
    o.observe(0, 1.0, None, None, True)
    assert [o.observe(s, 1.0) for s in range(1, 6)] == [None] * 5
    assert o.observe(6, NAN) is None
    assert o.observe(7, NAN, None, None, False) == Decision("fail", 6, "nonfinite_params")
    # checked every step (the baseline): where they were seen, whatever the loss did before
    o = Oracle()
    for s in range(5):
        assert o.observe(s, 1.0, None, None, True) is None
    assert o.observe(5, NAN, None, None, True) is None  # a skipped NaN step: weights still finite
    assert o.observe(6, NAN, None, None, False) == Decision("fail", 6, "nonfinite_params")
    o = Oracle()
    assert o.observe(0, 1.0, None, None, True) is None
    assert o.observe(1, math.inf, None, None, False) == Decision("fail", 1, "nonfinite_params")
    # a streak that began before the last check that found them finite: not where they broke
    o = Oracle()
    o.observe(0, 1.0, None, None, True)
    o.observe(1, NAN, None, None, True)
    o.observe(2, NAN)
    assert o.observe(3, 1.0, None, None, False) == Decision("fail", 3, "nonfinite_params")
    o = Oracle()
    o.observe(0, NAN, None, None, True)
    assert o.observe(1, NAN, None, None, False) == Decision("fail", 1, "nonfinite_params")


def test_no_scaler_observations():
    o = Oracle()
    for s in range(50):
        assert o.observe(s, 2.0 - s * 0.01) is None
    assert o.finish().outcome == "pass"


def test_divergence_against_reference():
    ref = {s: 2.0 * 0.97 ** s for s in range(100)}
    good = {s: v * 1.05 for s, v in ref.items()}
    bad = {s: (v if s < 60 else 2.0) for s, v in ref.items()}
    cfg = OracleConfig(divergence=1.5)
    o = Oracle(cfg, reference_losses=ref)
    for s, v in good.items():
        assert o.observe(s, v) is None
    assert o.finish().outcome == "pass"
    o = Oracle(cfg, reference_losses=ref)
    for s, v in bad.items():
        assert o.observe(s, v) is None
    d = o.finish()
    assert d.outcome == "fail" and d.reason == "divergence"
    # 2.0 > 1.5 * ref once ref < 1.333: ref(s) = 2 * 0.97**s -> s >= 14, but the bad curve
    # only leaves the reference at step 60.
    assert d.step == 60
    # Without a factor (or without a reference) divergence is not judged.
    o = Oracle(OracleConfig(), reference_losses=ref)
    for s, v in bad.items():
        o.observe(s, v)
    assert o.finish().outcome == "pass"


def test_blowup_fails_a_loss_that_grows_far_above_its_start():
    """bisect's all-FP32 control: a learning rate too high grows the loss in any precision; the control
    passed at the baseline's failure step + margin, long before its own loss turned non-finite."""
    losses = [1.0, 0.9, 1.1, 1.0, 1.0] + [1.0 * 1.5 ** k for k in range(1, 40)]  # base: mean 1.0
    o = Oracle(OracleConfig(blowup=100.0))
    got = [o.observe(s, v) for s, v in enumerate(losses)]
    # 1.5**12 = 130 > 100 from step 16 (loss index 5 + 11); five steps in a row above it at step 20
    first = next(i for i, d in enumerate(got) if d is not None)
    assert first == 20 and got[first] == Decision("fail", 16, "divergence"), got
    assert 1.5 ** 11 <= 100 < 1.5 ** 12
    # not without the setting; a noisy loss that stays within the factor passes
    o = Oracle()
    assert [o.observe(s, v) for s, v in enumerate(losses)] == [None] * len(losses)
    o = Oracle(OracleConfig(blowup=100.0))
    noisy = [1.0] * 5 + [5e7, 0.7, 2e3, 1e9, 0.5] * 10  # single bad batches, never 5 in a row above 100
    assert [o.observe(s, v) for s, v in enumerate(noisy)] == [None] * len(noisy)
    assert o.finish().outcome == "pass"
    # a loss that starts at or below zero is not judged; non-finite losses are nonfinite_loss's
    o = Oracle(OracleConfig(blowup=100.0))
    assert [o.observe(s, v) for s, v in enumerate([-1.0] * 5 + [1e9] * 10)] == [None] * 15
    o = Oracle(OracleConfig(blowup=100.0, nonfinite_k=3))
    got = [o.observe(s, v) for s, v in enumerate([1.0] * 5 + [1e3, math.inf, math.inf, math.inf])]
    assert got[-1] == Decision("fail", 6, "nonfinite_loss"), got
    with pytest.raises(ValueError, match="blowup=1"):
        OracleConfig(blowup=1.0)


def test_divergence_with_negative_losses():
    ref = {s: -1.0 for s in range(10)}
    o = Oracle(OracleConfig(divergence=1.5), reference_losses=ref)
    for s in range(10):
        o.observe(s, -0.2)  # 0.8 above a reference of magnitude 1 > 0.5
    assert o.finish() == Decision("fail", 0, "divergence")


def test_config_roundtrip_and_validation():
    cfg = OracleConfig(nonfinite_k=5, divergence=2.0)
    assert OracleConfig.from_json(cfg.to_json()) == cfg
    assert OracleConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown OracleConfig keys"):
        OracleConfig.from_dict({"nonfinite": 3})
    with pytest.raises(ValueError, match="skip_frac=0"):
        OracleConfig(skip_frac=0)
    with pytest.raises(ValueError, match="nonfinite_k=0"):
        OracleConfig(nonfinite_k=0)


def test_settled_only_outside_a_nan_streak_and_a_skip():
    o = Oracle()
    assert o.settled()
    o.observe(0, 1.0, 1024.0, False, True)
    assert o.settled()
    o.observe(1, math.nan, 512.0, True, True)
    assert not o.settled()  # a NaN loss, one short of a failure
    o.observe(2, 1.0, 512.0, True, True)
    assert not o.settled()  # a finite loss, but skipped: the skip window may yet trip
    o.observe(3, 1.0, 512.0, False, True)
    assert o.settled() and o.finish().outcome == "pass"
