"""numpy's global generator set aside and put back through its words (`numpy_generator`): the
same numbers as numpy's own `get_state`/`set_state`, a cached Gaussian included."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from silo_pfl import numpy_generator


@pytest.fixture(autouse=True)
def _restore_global_generator() -> Iterator[None]:
    generator, state = np.random.get_bit_generator(), np.random.get_state()
    yield
    np.random.set_bit_generator(generator)
    np.random.set_state(state)


def _same(token: tuple[str, object], state: tuple) -> bool:
    mine = numpy_generator.legacy(token)
    return (
        mine[0] == state[0]
        and np.array_equal(mine[1], state[1])
        and tuple(mine[2:]) == tuple(state[2:])
    )


def test_the_words_are_numpys_state_when_no_gaussian_is_cached(monkeypatch):
    np.random.seed(7)
    np.random.random(5)
    numpy_generator.get()  # numpy's own read once, as a silo's first call makes it
    np.random.random(700)  # past a regeneration of the 624 words
    np.random.standard_normal(2)  # a pair: nothing cached
    first = numpy_generator.get()
    assert _same(first, np.random.get_state())
    reads = []
    numpys_own = np.random.get_state
    monkeypatch.setattr(np.random, "get_state", lambda **kw: reads.append(1) or numpys_own(**kw))
    second = numpy_generator.get()
    numpy_generator.put(second)
    assert numpy_generator.get()[0] == "words"
    assert reads == [], "unchanged words since a clean read: numpy's own read is not needed"
    monkeypatch.undo()
    assert _same(second, np.random.get_state())


def test_a_cached_gaussian_is_taken_and_put_back_with_numpys_own_calls():
    np.random.seed(3)
    np.random.standard_normal()  # draws a pair, caches the second
    assert np.random.get_state()[3] == 1
    token = numpy_generator.get()
    assert token[0] == "state" and _same(token, np.random.get_state())
    expected = np.random.standard_normal(3)
    np.random.seed(99)
    numpy_generator.put(token)
    assert np.array_equal(np.random.standard_normal(3), expected)


def test_put_back_words_clears_a_gaussian_cached_since():
    np.random.seed(5)
    token = numpy_generator.get()
    assert token[0] == "words"
    expected = np.random.standard_normal(4)
    numpy_generator.put(token)
    np.random.standard_normal()  # draws a pair, caches the second
    assert np.random.get_state()[3] == 1
    numpy_generator.put(token)
    assert np.array_equal(np.random.standard_normal(4), expected)


def test_two_streams_interleaved_draw_what_each_draws_alone():
    """Two silos' generators swapped in and out around each call, as `SiloGroup.call` does,
    with odd numbers of Gaussians so that either may hold a cached one."""
    draws = [1, 3, 2, 1, 4, 1]

    def alone(seed: int) -> list[np.ndarray]:
        np.random.seed(seed)
        return [np.concatenate([np.random.standard_normal(n), np.random.random(n)]) for n in draws]

    expected = {seed: alone(seed) for seed in (11, 12)}
    tokens = {}
    for seed in (11, 12):
        np.random.seed(seed)
        tokens[seed] = numpy_generator.get()
    seen: dict[int, list[np.ndarray]] = {11: [], 12: []}
    for n in draws:
        for seed in (11, 12):
            numpy_generator.put(tokens[seed])
            seen[seed].append(np.concatenate([np.random.standard_normal(n), np.random.random(n)]))
            tokens[seed] = numpy_generator.get()
    for seed in (11, 12):
        for mine, theirs in zip(seen[seed], expected[seed], strict=True):
            assert np.array_equal(mine, theirs)


def test_another_kind_of_bit_generator_goes_through_numpys_calls():
    np.random.set_bit_generator(np.random.PCG64(1))
    token = numpy_generator.get()
    assert token[0] == "state"
    expected = np.random.random(4)
    numpy_generator.put(token)
    assert np.array_equal(np.random.random(4), expected)
