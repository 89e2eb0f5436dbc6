"""The exact greedy over prefix-constrained units (workers/sparsity/greedy.py): known answers for every
implementation (the paper's argmin loop included), and sort / heap equal to the argmin loop on random tie-heavy
cases. Together ~0.3 s."""
from __future__ import annotations

import numpy as np
import pytest

from workers.sparsity.greedy import greedy_allocate, greedy_reference

IMPLS = {
    "sort": lambda *a: greedy_allocate(*a, impl="sort"),
    "heap": lambda *a: greedy_allocate(*a, impl="heap"),
    "reference": greedy_reference,
}


@pytest.mark.parametrize("impl", IMPLS)
def test_known_answers_cheapest_step_first_ties_to_the_lower_unit(impl):
    run = IMPLS[impl]
    # unit 0: marginals 1, 2, 3; unit 1: marginals 2, 0.5, 7.5 (not convex: its cheap 2nd step waits for its 1st)
    costs = [np.array([0.0, 1.0, 3.0, 6.0]), np.array([0.0, 2.0, 2.5, 10.0])]
    want = {0: [0, 0], 1: [1, 0],
            2: [2, 0],          # unit 0's 2nd step (2) ties unit 1's 1st (2): the lower unit goes first
            3: [2, 1], 4: [2, 2],   # then unit 1's 1st, which opens its 0.5 step
            5: [3, 2], 6: [3, 3], 9: [3, 3]}
    for budget, steps in want.items():
        assert run(costs, budget).tolist() == steps, (impl, budget)
    # start: steps already taken; sizes: the budget counts sizes and the last step may overshoot it
    assert run(costs, 2, [0, 2]).tolist() == [2, 2]
    sizes = [np.array([1.0, 1.0, 1.0]), np.array([3.0, 1.0, 1.0])]
    assert run(costs, 2, None, sizes).tolist() == [2, 0]
    assert run(costs, 3, None, sizes).tolist() == [2, 1]          # 2 + 3 = 5 >= 3: stops there
    assert run(costs, 6, None, sizes).tolist() == [2, 2]
    assert run(costs, 6.5, None, sizes).tolist() == [3, 2]


def test_greedy_implementations_agree_with_the_argmin_loop_on_ties_and_sizes():
    rng = np.random.default_rng(0)
    for trial in range(400):
        U = int(rng.integers(1, 7))
        lens = rng.integers(0, 6, size=U)
        costs = [np.concatenate([[0], rng.integers(-1 if trial % 3 == 0 else 0, 3, size=n)]).cumsum().astype(float)
                 for n in lens]                                  # small integers: many exact ties
        start = np.array([rng.integers(0, n + 1) for n in lens])
        sizes = [rng.integers(0, 4, size=n) for n in lens] if trial % 2 else None
        budget = int(rng.integers(-1, 2 * lens.sum() + 2))
        ref = greedy_reference(costs, budget, start, sizes)
        for impl in ("sort", "heap"):
            assert np.array_equal(greedy_allocate(costs, budget, start, sizes, impl=impl), ref), (trial, impl)
    with pytest.raises(ValueError, match="finite"):
        greedy_allocate([np.array([0.0, np.nan])], 1)
