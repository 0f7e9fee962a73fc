"""Sampler and SamplingParams: greedy, masks, seeds, min_tokens, validation."""

from __future__ import annotations

import pytest
import torch

from forwardkit.engine.request import Request
from forwardkit.engine.sampler import Sampler, apply_min_p, apply_top_k_top_p, greedy_tokens
from forwardkit.engine.sampling_params import SamplingParams, as_params_list


def _req(params: SamplingParams, seed: int | None = None, eos: int | None = None) -> Request:
    gen = None
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
    return Request("r", [1], params, eos_token_id=eos, generator=gen)


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    reqs = [_req(SamplingParams(temperature=0)), _req(SamplingParams(temperature=0))]
    assert Sampler()(logits, reqs) == [1, 0]


def test_plain_greedy_batch_takes_the_argmax_path_with_the_same_tokens(monkeypatch):
    """All-greedy rows without logprobs, penalties or pending min_tokens: argmax of the logits
    as given (no copy, no _draw), token for token what the full path picks, ties included."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50_000, generator=gen)
    logits[1, [7, 300, 49_999]] = 40.0  # a tie: the first index wins on both paths
    logits[2, -1] = 50.0  # the last column
    for dtype in (torch.float32, torch.bfloat16):
        rows = logits.to(dtype)
        reqs = [_req(SamplingParams(temperature=0)) for _ in range(6)]
        full = Sampler()._draw(rows.float().clone(), reqs, [r.sampling_params for r in reqs])
        monkeypatch.setattr(Sampler, "_draw", staticmethod(lambda *a: pytest.fail("full path")))
        fast = Sampler()(rows, reqs)
        monkeypatch.undo()
        assert fast == full and fast[1] == 7 and fast[2] == 49_999
        assert fast == rows.float().argmax(dim=-1).tolist()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, logprobs=0),
    SamplingParams(temperature=0, repetition_penalty=1.5),
    SamplingParams(temperature=0, min_tokens=2),
    SamplingParams(temperature=0.7),
])
def test_any_row_needing_more_than_argmax_takes_the_full_path(params, monkeypatch):
    drawn = []
    real = Sampler._draw

    def spy(*args):
        drawn.append(True)
        return real(*args)

    monkeypatch.setattr(Sampler, "_draw", staticmethod(spy))
    reqs = [_req(SamplingParams(temperature=0)), _req(params, seed=1)]
    Sampler()(torch.randn(2, 100), reqs)
    assert drawn == [True]


@pytest.mark.parametrize("vocab", [128_256, 151_936, 3 * 4096, 5000, 4095, 2100, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_greedy_equals_argmax_on_ties_nan_and_infinities(vocab, dtype):
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=gen)
    x[1] = 1.0  # every entry maximal: index 0
    last = vocab - 1
    x[2, [min(2047, last), min(2048, last)]] = 9.0  # a tie across a chunk boundary
    x[3, [last - 1, last]] = 9.0  # a tie in the tail past the last whole chunk
    x[4] = float("-inf")
    x[5, [10, last]] = float("nan")  # NaN counts as maximal: the first one
    x[6, [vocab // 2, vocab // 3]] = float("inf")
    x[7] = -x[7].abs()
    x[7, [3, 5]] = torch.tensor([-0.0, 0.0])  # signed zeros compare equal: the first
    x[8, last] = 50.0
    x = x.to(dtype)
    assert greedy_tokens(x) == x.argmax(dim=-1).tolist()
    assert greedy_tokens(x[:, : vocab - 1]) == x[:, : vocab - 1].argmax(dim=-1).tolist()  # strided rows


def test_greedy_resets_other_knobs():
    p = SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.2)
    assert (p.top_k, p.top_p, p.min_p) == (0, 1.0, 0.0) and p.greedy


def test_top_k_mask():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [1.0, 4.0, 3.0, 2.0]])
    out = apply_top_k_top_p(logits.clone(), torch.tensor([2, 0]), None)
    assert torch.isinf(out[0]).tolist() == [True, False, False, True]
    assert not torch.isinf(out[1]).any()  # 0 = disabled


def test_top_p_mask():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    out = apply_top_k_top_p(logits.clone(), None, torch.tensor([0.75]))
    # 0.5 + 0.3 reaches 0.75: the two most likely survive.
    assert torch.isinf(out[0]).tolist() == [False, False, True, True]
    out = apply_top_k_top_p(logits.clone(), None, torch.tensor([0.01]))
    assert torch.isinf(out[0]).tolist() == [False, True, True, True]  # top token always kept
    out = apply_top_k_top_p(logits.clone(), None, torch.tensor([1.0]))
    assert not torch.isinf(out).any()


def test_min_p_mask():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    out = apply_min_p(logits.clone(), torch.tensor([0.5]))
    assert torch.isinf(out[0]).tolist() == [False, False, True, True]


def test_sampling_respects_top_k():
    torch.manual_seed(0)
    logits = torch.randn(1, 50)
    allowed = set(logits[0].topk(3).indices.tolist())
    params = SamplingParams(temperature=1.5, top_k=3)
    for seed in range(40):
        (tok,) = Sampler()(logits, [_req(params, seed=seed)])
        assert tok in allowed


def test_seed_reproducible_and_batch_independent():
    torch.manual_seed(0)
    logits = torch.randn(3, 100)
    params = SamplingParams(temperature=1.0)

    def draw(seeds):
        reqs = [_req(params, seed=s) for s in seeds]
        sampler = Sampler()
        return [sampler(logits[: len(reqs)], reqs) for _ in range(5)]

    assert draw([1, 2, 3]) == draw([1, 2, 3])
    # Request 0 draws the same tokens alone or with neighbours: generators are per request.
    alone = [_req(params, seed=1)]
    solo = [Sampler()(logits[:1], alone)[0] for _ in range(5)]
    assert solo == [row[0] for row in draw([1, 2, 3])]
    assert draw([1, 2, 3]) != draw([4, 5, 6])


def test_sampling_follows_distribution():
    logits = torch.tensor([[0.0, 0.0, -1e9]])
    params = SamplingParams(temperature=1.0)
    req = _req(params, seed=0)
    counts = [0, 0, 0]
    for _ in range(400):
        counts[Sampler()(logits, [req])[0]] += 1
    assert counts[2] == 0 and 120 < counts[0] < 280


def test_min_tokens_masks_eos_and_stop():
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0]])
    params = SamplingParams(temperature=0, min_tokens=1, stop_token_ids=[3])
    req = _req(params, eos=2)
    assert Sampler()(logits, [req]) == [1]  # EOS (2) and stop token (3) masked
    req.output_token_ids.append(0)
    assert Sampler()(logits, [req]) == [2]


def test_row_count_mismatch():
    with pytest.raises(ValueError, match="2 logits rows for 1 requests"):
        Sampler()(torch.zeros(2, 3), [_req(SamplingParams())])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"n": 1.0}, "n"),
        ({"seed": "x"}, "seed"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": -2}, "logprobs"),
        ({"prompt_logprobs": 1.5}, "prompt_logprobs"),
        ({"stop": 5}, "stop"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}=") as info:
        SamplingParams(**kwargs)
    # The message shows the bad value and what is accepted.
    bad = next(iter(kwargs.values())) if len(kwargs) == 1 else kwargs[field]
    msg = str(info.value)
    assert repr(bad)[:20] in msg and ("expected" in msg or "must" in msg)


def test_sampling_params_lists_normalised():
    p = SamplingParams(stop="x", stop_token_ids=(3, 4))
    assert p.stop == ["x"] and p.stop_token_ids == [3, 4]
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]
    assert SamplingParams().stop == [] and not SamplingParams().has_penalties
    assert SamplingParams(repetition_penalty=1.2).has_penalties


def test_as_params_list():
    p = SamplingParams(max_tokens=3)
    assert as_params_list(p, 2) == [p, p]
    assert len(as_params_list(None, 3)) == 3
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        as_params_list([p], 2)
    with pytest.raises(ValueError, match=r"sampling_params\[1\] is dict"):
        as_params_list([p, {"temperature": 0}], 2)
    with pytest.raises(ValueError, match="sampling_params=5 is invalid"):
        as_params_list(5, 1)


@pytest.mark.parametrize("temperature, low, high", [
    (0.25, 0, 70),      # p(token 0) = 1 / (1 + 3**4) ~ 1.2%: about 24 of 2000
    (1.0, 420, 580),    # 1 / (1 + 3) = 25%: about 500
    (4.0, 780, 950),    # 1 / (1 + 3**0.25) ~ 43%: about 864
])
def test_temperature_divides_the_logits(temperature, low, high):
    """Two tokens with logits 0 and ln 3: at temperature T token 0 has probability
    1 / (1 + 3**(1/T)). A sampler that ignores T draws it 25% of the time at every T."""
    n = 2000
    logits = torch.tensor([[0.0, float(torch.log(torch.tensor(3.0)))]]).repeat(n, 1)
    params = SamplingParams(temperature=temperature)
    tokens = Sampler()(logits, [_req(params, seed=s) for s in range(n)])
    assert low <= tokens.count(0) <= high, (temperature, tokens.count(0))


def test_logprobs_come_from_the_raw_logits_not_the_masked_or_penalised_ones():
    """min_tokens masks EOS (token 2) and a repetition penalty lowers the prompt's token (1);
    the logprobs still describe the model's raw distribution (vLLM's default
    ``logprobs_mode``: raw logprobs), while the draw sees the masked, penalised logits."""
    logits = torch.tensor([[0.0, 5.0, 9.0, 8.0]])
    params = SamplingParams(temperature=0, logprobs=4, min_tokens=1, repetition_penalty=4.0)
    req = Request("r", [1], params, eos_token_id=2)
    tokens, per_row = Sampler().sample(logits, [req])
    assert tokens == [3]  # EOS masked, token 1 penalised 5 -> 1.25
    assert per_row is not None and per_row[0] is not None
    raw = logits[0].log_softmax(-1)
    got = {tok: lp.logprob for tok, lp in per_row[0].items()}
    assert set(got) == {0, 1, 2, 3}
    for tok, value in got.items():
        assert value == pytest.approx(float(raw[tok]), abs=1e-6), tok
    assert per_row[0][2].rank == 1 and per_row[0][3].rank == 2
