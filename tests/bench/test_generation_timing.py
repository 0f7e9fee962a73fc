"""time_generation: decode time that drowns in noise is measured again, fastest kept."""

from __future__ import annotations

import pytest

from forwardkit.bench import generation as gen


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    """The bench's clock replaced by one that moves only when the fake generate runs."""
    fake = FakeClock()
    monkeypatch.setattr(gen.time, "perf_counter", fake)
    return fake


def _fake_generate(clock: FakeClock, first_times: list[float], full_times: list[float]):
    calls = {"first": 0, "full": 0}

    def fn(prompts, n):
        kind = "first" if n == 1 else "full"
        times = first_times if kind == "first" else full_times
        clock.now += times[min(calls[kind], len(times) - 1)]
        calls[kind] += 1
        return [[0] * n for _ in prompts]

    return fn, calls


def test_a_noisy_first_measurement_is_retried(clock):
    # the first 1-token run is slow (a cold cache): decode would come out negative
    fn, calls = _fake_generate(clock, [5.0, 1.0, 1.0], [3.0, 3.0, 3.0])
    first, full = gen.time_generation(fn, [[1, 2]], 4)
    assert (first, full) == (1.0, 3.0) and calls == {"first": 2, "full": 2}


def test_a_clear_decode_time_is_measured_once(clock):
    fn, calls = _fake_generate(clock, [0.4], [3.5])
    assert gen.time_generation(fn, [[1]], 32) == (0.4, 3.5) and calls == {"first": 1, "full": 1}


def test_a_short_generation_is_an_error():
    with pytest.raises(RuntimeError, match="generated 2 tokens instead of 5"):
        gen.time_generation(lambda prompts, n: [[0] * min(n, 2)], [[1]], 4)


def test_a_negative_decode_time_is_measured_again_past_the_tries(clock):
    """A busy machine can make the 1-token run slower than the full one for every try: those
    runs are measured again (up to 4 x tries) rather than reported as a negative decode time."""
    fn, calls = _fake_generate(clock, [5.0, 5.0, 5.0, 1.0], [3.0])
    assert gen.time_generation(fn, [[1]], 4) == (1.0, 3.0) and calls == {"first": 4, "full": 4}


def test_a_small_positive_decode_time_stops_at_the_tries(clock):
    fn, calls = _fake_generate(clock, [1.0], [1.25])
    assert gen.time_generation(fn, [[1]], 4) == (1.0, 1.25) and calls == {"first": 3, "full": 3}


def test_a_decode_time_never_positive_is_an_error(clock):
    fn, calls = _fake_generate(clock, [5.0], [3.0])
    with pytest.raises(RuntimeError, match=r"decode time not measurable: 5 tokens took 3\.0000 s, "
                                           r"1 token 5\.0000 s"):
        gen.time_generation(fn, [[1]], 4)
    assert calls == {"first": 12, "full": 12}
