"""A prompt prefilled once per group: the admission's slots gG .. gG + G - 1 hold G samples of
one prompt (``pipeline.carry.admit``), so the prompt prefill runs on each group's first slot and
copies its cache and hidden state to the other G - 1 (``rollout.admission.prompt_prefill``).

Reference: the same admission prefilled slot by slot (``group_size`` 1)."""

import jax
import numpy as np
import pytest

from oppo_jax.models import init_params
from oppo_jax.pipeline.accounting import admission_computed, admission_real
from oppo_jax.pipeline.carry import AdmitRule, CarryBuffer, admit, prompt_sharing
from oppo_jax.pipeline.program_walk import shape_checks_off
from oppo_jax.scoring.stream import ScorerSpec, scorer_admit
from tests.ppo_fixtures import ACTOR, CRITIC, ListPrompts, eager_admission

P, R, G = 6, 8, 3


def _grouped_slots(groups: int, extra_groups: int = 1, group_size: int = G):
    """``groups`` prompts of different lengths, ``group_size`` samples each, in slots of
    ``groups + extra_groups`` groups (the extra ones empty)."""
    rng = np.random.default_rng(0)
    pairs = [(i, rng.integers(2, 60, int(rng.integers(1, P + 1)))) for i in range(groups)]
    n = groups * group_size
    rule = AdmitRule(n, n + extra_groups * group_size, False, 2, group_size)
    return admit(CarryBuffer(), ListPrompts(pairs), rule, P, R)


@pytest.mark.parametrize("kind", ["logprob", "value", "score"])
def test_a_group_prefilled_once_equals_every_slot_prefilled(kind):
    model = ACTOR if kind == "logprob" else CRITIC
    spec = ScorerSpec(model, kind, R, temperature=0.7)
    params = init_params(model, jax.random.key(1))
    slots = _grouped_slots(3)
    assert slots.shared_prompts(G) == G
    admission = eager_admission(slots)
    shared = scorer_admit(spec, params, admission, P, group_size=G)
    each = scorer_admit(spec, params, admission, P)
    active = np.asarray(slots.active)
    for name in ("last_hidden", "score", "per_token"):
        got, want = np.asarray(getattr(shared, name)), np.asarray(getattr(each, name))
        np.testing.assert_allclose(got[active], want[active], rtol=1e-5, atol=1e-5, err_msg=name)
    np.testing.assert_array_equal(shared.cache.length, each.cache.length)
    for got, want in ((shared.cache.k, each.cache.k), (shared.cache.v, each.cache.v)):
        got, want = np.asarray(got)[:, active], np.asarray(want)[:, active]
        width = P  # the prompt columns; the rest is the fresh cache's zeros in both
        np.testing.assert_allclose(got[..., :width, :], want[..., :width, :], atol=1e-5)
    # The G slots of a group hold one copy: equal to the bit.
    k = np.asarray(shared.cache.k).reshape(model.num_layers, -1, G, *shared.cache.k.shape[2:])
    np.testing.assert_array_equal(k, np.repeat(k[:, :, :1], G, axis=2))


def test_a_group_size_that_does_not_divide_the_slots_is_refused():
    """The caller decides the sharing (``prompt_sharing`` passes 1 when G does not divide S);
    the prefill does not fall back on its own."""
    spec = ScorerSpec(ACTOR, "logprob", R, temperature=0.7)
    params = init_params(ACTOR, jax.random.key(1))
    admission = eager_admission(_grouped_slots(3))  # 4 groups of 3: 12 slots
    assert prompt_sharing(admission.num_slots, 5) == 1
    with pytest.raises(ValueError, match="group_size 5 does not divide the 12 slots"):
        scorer_admit(spec, params, admission, P, group_size=5)


def test_shared_prompts_follows_the_layout_and_refuses_mixed_groups():
    slots = _grouped_slots(2)
    assert slots.shared_prompts(G) == G and slots.shared_prompts(1) == 1
    assert prompt_sharing(10, 4) == 1 and prompt_sharing(12, 4) == 4  # S not a multiple of G
    slots.prompt_ids[1] = 99  # a group holding two prompts: the layout is broken
    with pytest.raises(RuntimeError, match="not whole groups of 3"):
        slots.shared_prompts(G)
    mixed = _grouped_slots(2)
    mixed.active[G] = False  # an empty slot inside an occupied group
    with pytest.raises(RuntimeError, match="not whole groups"):
        mixed.shared_prompts(G)


def test_the_ledger_counts_each_groups_prompt_once():
    assert admission_computed(12, 16, (), shared=4) == 3 * 16
    assert admission_computed(12, 16) == 12 * 16
    # 2 groups of 2 (a carried one with prefixes 5 and 7, a new one) and 2 empty slots
    prompt, prefix = np.array([3, 3, 4, 4, 0, 0]), np.array([5, 7, 0, 0, 0, 0])
    active, carrying = prompt > 0, prefix > 0
    lens = (prompt, prefix, active, carrying)
    assert admission_real(*lens, trained=1, frozen=0, shared=2) == 3 + 4 + 5 + 7
    assert admission_real(*lens, trained=0, frozen=1, shared=2) == 4  # the new prompt, once
    assert admission_real(*lens, trained=1, frozen=0) == 3 + 3 + 4 + 4 + 5 + 7


def test_the_shared_prefill_computes_a_third_of_the_flops():
    """XLA's own count: the prompt prefill of 3 groups of 3 slots costs about a third of the
    slot-by-slot one (the copies are no FLOPs)."""
    spec = ScorerSpec(ACTOR, "logprob", R, temperature=0.7)
    params = init_params(ACTOR, jax.random.key(1))
    admission = eager_admission(_grouped_slots(3, extra_groups=0))

    def flops(group_size: int) -> float:
        run = jax.jit(lambda p, a: scorer_admit(spec, p, a, P, group_size=group_size))
        with shape_checks_off():  # lowering rebuilds the typed admission from abstract leaves
            cost = run.lower(params, admission).compile().cost_analysis()
        return float((cost[0] if isinstance(cost, list) else cost)["flops"])

    assert flops(G) < 0.45 * flops(1)
