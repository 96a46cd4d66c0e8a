"""A merge's tensors keep read_adapter's column-major layout (A [r, in] stored as [in, r], B [out, r] as
[r, out]): installing it into a device pool is then a plain copy, not a transposing one (issue 29: the cold merge's
extra TTFT). Values are those of the plain concatenation."""

import torch

from app.replica.lora.merge import merge_adapters
from app.replica.lora.weights import LoraWeights, pad_ranks


def _col(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def _lw(name: str, r: int, layers=(0, 1), scale: float = 2.0, seed: int = 0) -> LoraWeights:
    g = torch.Generator().manual_seed(seed)
    tensors = {
        (lay, "q_proj"): (_col(torch.randn(r, 16, generator=g)), _col(torch.randn(12, r, generator=g)))
        for lay in layers
    }
    return LoraWeights(name, r, scale * r, False, scale, frozenset({"q_proj"}), tuple(layers), tensors)


def _column_major(t: torch.Tensor) -> bool:
    return t.t().is_contiguous()


def test_cat_merge_is_column_major_and_exact():
    a, b, c = _lw("a", 4, seed=1), _lw("b", 3, scale=0.5, seed=2), _lw("c", 5, seed=3)
    m = merge_adapters([(a, 0.5), (b, 0.3), (c, 0.2)], "m")
    for key, (ma, mb) in m.tensors.items():
        assert _column_major(ma) and _column_major(mb)
        want_a = torch.cat([w * lw.scale * lw.tensors[key][0] for lw, w in ((a, 0.5), (b, 0.3), (c, 0.2))], 0)
        want_b = torch.cat([lw.tensors[key][1] for lw in (a, b, c)], 1)
        torch.testing.assert_close(ma, want_a, rtol=0, atol=0)
        torch.testing.assert_close(mb, want_b, rtol=0, atol=0)
        delta = sum(w * lw.delta(*key) for lw, w in ((a, 0.5), (b, 0.3), (c, 0.2)))
        torch.testing.assert_close(m.delta(*key), delta)


def test_row_major_terms_merge_the_same():
    a, b = _lw("a", 4, seed=1), _lw("b", 3, seed=2)
    rows = LoraWeights(
        "r", 3, 6.0, False, 2.0, b.target_modules, b.layers,
        {k: (x.contiguous(), y.contiguous()) for k, (x, y) in b.tensors.items()},
    )  # fmt: skip
    m1, m2 = merge_adapters([(a, 1.0), (b, -1.0)], "m"), merge_adapters([(a, 1.0), (rows, -1.0)], "m")
    for key in m1.tensors:
        torch.testing.assert_close(m1.tensors[key][0], m2.tensors[key][0], rtol=0, atol=0)
        torch.testing.assert_close(m1.tensors[key][1], m2.tensors[key][1], rtol=0, atol=0)


def test_merge_of_terms_on_different_layers_is_padded_column_major():
    a, b = _lw("a", 4, layers=(0, 1), seed=1), _lw("b", 3, layers=(1,), seed=2)
    m = merge_adapters([(a, 1.0), (b, 1.0)], "m")
    (a0, b0), (a1, b1) = m.tensors[(0, "q_proj")], m.tensors[(1, "q_proj")]
    assert a0.shape == a1.shape == (7, 16) and b0.shape == b1.shape == (12, 7)
    assert all(_column_major(t) for t in (a0, b0, a1, b1))
    assert not a0[4:].any() and not b0[:, 4:].any()  # the padding adds nothing
    torch.testing.assert_close(m.delta(0, "q_proj"), a.delta(0, "q_proj"))


def test_pad_ranks_keeps_values_and_layout():
    g = torch.Generator().manual_seed(0)
    t = {
        (0, "v_proj"): (_col(torch.randn(2, 8, generator=g)), _col(torch.randn(6, 2, generator=g))),
        (1, "v_proj"): (_col(torch.randn(5, 8, generator=g)), _col(torch.randn(6, 5, generator=g))),
    }
    p = pad_ranks(t)
    (pa, pb) = p[(0, "v_proj")]
    assert pa.shape == (5, 8) and pb.shape == (6, 5) and _column_major(pa) and _column_major(pb)
    torch.testing.assert_close(pb @ pa, t[(0, "v_proj")][1] @ t[(0, "v_proj")][0])
    assert p[(1, "v_proj")][0] is t[(1, "v_proj")][0]  # the widest is left as is
