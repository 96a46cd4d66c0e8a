"""The sampler alone: every value SamplingParams accepts is sampled without inf/NaN, the ones it cannot honour
are refused naming the field and range, and a broken row (non-finite logits, an exception) fails alone while
every other row gets exactly the token, and leaves its generator exactly where, it would have anyway."""

import math

import pytest
import torch

from app.errors import InvalidRequest
from app.replica.sampler_state import SamplerState
from app.replica.sampling import NonFiniteLogits, sample
from app.sampling_params import SAMPLING_EPS, SEED_MAX, SEED_MIN, SamplingParams

V = 384


def logits_rows(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, V, generator=g) * 3


@pytest.mark.parametrize(
    "kw, field, words",
    [
        (dict(seed=2**70), "seed", "[-9223372036854775808, 9223372036854775807]"),
        (dict(seed=SEED_MIN - 1), "seed", "signed 64-bit"),
        (dict(seed=10**5000), "seed", "an integer of 16610 bits"),  # not echoed whole
        (dict(seed=1.5), "seed", "got 1.5"),
        (dict(seed=True), "seed", "got True"),
        (dict(temperature=math.nan), "temperature", "finite number >= 0"),
        (dict(temperature=math.inf), "temperature", "got inf"),
        (dict(temperature=-1e-300), "temperature", "finite number >= 0"),
        (dict(temperature="0.5"), "temperature", "got '0.5'"),
        (dict(top_p=math.nan), "top_p", "in (0, 1]"),
        (dict(top_p=0.0), "top_p", "in (0, 1]"),
        (dict(top_k=2.5), "top_k", "positive integer"),
        (dict(max_tokens=0), "max_tokens", ">= 1"),
        (dict(stop=[""]), "stop", "non-empty"),
        (dict(stop_token_ids=["x"]), "stop_token_ids", "integer token ids"),
    ],
)
def test_values_the_sampler_cannot_honour_are_refused_naming_the_field(kw, field, words):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams.from_kwargs(**kw)
    assert str(e.value).startswith(f"{field}: ") and words in str(e.value)
    assert e.value.param == field
    assert len(str(e.value)) < 200


def test_seed_range_ends_are_accepted_and_draw():
    rows = logits_rows(2)
    params = [SamplingParams(temperature=1.0, seed=SEED_MIN), SamplingParams(temperature=1.0, seed=SEED_MAX)]
    assert all(isinstance(t, int) for t in sample(rows, params, [SamplerState(), SamplerState()]))


def test_tiny_temperatures_are_greedy_and_small_ones_are_finite():
    rows = logits_rows(4)
    greedy = rows.argmax(-1).tolist()
    tiny = [SamplingParams(temperature=t) for t in (1e-300, 5e-324, SAMPLING_EPS / 2, 0.0)]
    assert all(p.greedy for p in tiny)
    assert sample(rows, tiny, [SamplerState() for _ in tiny]) == greedy
    # the smallest sampled temperature on logits as far apart as float32 allows: a valid token, no NaN
    extreme = torch.full((3, V), -3.0e38)
    extreme[:, 7] = 3.0e38
    ps = [
        SamplingParams(temperature=SAMPLING_EPS, seed=1),
        SamplingParams(temperature=2.0, seed=1, top_k=5),
        SamplingParams(temperature=1e300, seed=1, top_p=0.5),
    ]
    out = sample(extreme, ps, [SamplerState() for _ in ps])
    assert out[:2] == [7, 7] and isinstance(out[2], int)


def test_broken_rows_fail_alone_and_the_others_are_untouched():
    rows = logits_rows(6, seed=1)
    params = [
        SamplingParams(temperature=0.8, seed=11, top_k=40, top_p=0.9),
        SamplingParams(),  # greedy
        SamplingParams(temperature=1.0, seed=12),
        SamplingParams(temperature=0.7, seed=13, top_p=0.5),
        SamplingParams(),
        SamplingParams(temperature=1.3, seed=14, top_k=3),
    ]

    def draws(logits, check=None, steps=5):
        states = [SamplerState() for _ in params]
        return [sample(logits, params, states, check) for _ in range(steps)]

    clean = draws(rows)
    broken = rows.clone()
    broken[1, 5] = math.nan  # a greedy row: argmax of NaN would be garbage
    broken[2, 9] = math.inf
    broken[3, :] = -math.inf

    def check(i):
        if i == 4:
            raise RuntimeError("injected")

    dirty = draws(broken, check)
    for step_clean, step_dirty in zip(clean, dirty):
        for i in (0, 5):  # the healthy rows: same tokens, step after step (their generators untouched)
            assert step_dirty[i] == step_clean[i]
        assert all(isinstance(step_dirty[i], NonFiniteLogits) for i in (1, 2, 3))
        assert isinstance(step_dirty[4], RuntimeError) and str(step_dirty[4]) == "injected"


def test_an_error_in_the_batched_part_is_traced_to_its_row():
    """If the batched probabilities raise because of one row (here a top_k that slipped past validation), each
    row is retried alone: the others still get their tokens, from generators nothing was drawn from yet."""
    rows = logits_rows(3, seed=2)
    params = [SamplingParams(temperature=0.9, seed=s, top_k=50) for s in (1, 2, 3)]
    want = sample(rows, params, [SamplerState() for _ in params])
    bad = SamplingParams(temperature=0.9, seed=2)
    object.__setattr__(bad, "top_k", 2.5)  # a float k: the batched topk raises for every row
    out = sample(rows, [params[0], bad, params[2]], [SamplerState() for _ in params])
    assert out[0] == want[0] and out[2] == want[2]
    assert isinstance(out[1], TypeError)


def test_a_finite_row_whose_sum_overflows_is_not_failed():
    x = torch.full((3, V), 3.0e38)  # finite; the row sum (the cheap check) overflows to inf
    x[0, 5] = 3.3e38
    x[1, 0] = math.nan
    x[2, 3] = -math.inf
    out = sample(
        x,
        [SamplingParams(temperature=0.5, seed=1), SamplingParams(), SamplingParams()],
        [SamplerState() for _ in range(3)],
    )
    assert isinstance(out[0], int)
    assert isinstance(out[1], NonFiniteLogits) and isinstance(out[2], NonFiniteLogits)
