"""`_torch_meta.on_meta`: the results it makes for plain meta tensors are PyTorch's
own (shape, dtype, device, contiguity), and it makes none where it cannot say."""

import pytest


torch = pytest.importorskip("torch")
F = torch.nn.functional

from bridge._adapters._torch_meta import on_meta  # noqa: E402
from bridge._adapters._torch_trace import _name_of  # noqa: E402


def meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


def _made(func, *args, **kwargs):
    return on_meta(_name_of(func, {})[0], func, args, kwargs, torch)


CASES = [
    (torch.add, meta(2, 1, 4), meta(3, 1)),
    (torch.Tensor.__rsub__, meta(2, 3), 1.0),
    (torch.Tensor.__mul__, meta(2, 3, dtype=torch.float16), 2),
    (torch.mul, meta(2, 3, dtype=torch.float16), meta(3)),
    (F.silu, meta(2, 3)),
    (torch.Tensor.mean, meta(2, 3, 4), -1, True),
    (torch.cat, (meta(1, 2, 5, 4), meta(1, 2, 5, 3)), -1),
    (torch.cat, [meta(3, 4), meta(2, 4)]),
    (F.linear, meta(2, 5, 4), meta(6, 4), meta(6)),
    (F.linear, meta(4), meta(6, 4)),
    (torch.matmul, meta(2, 1, 5, 4), meta(3, 4, 7)),
    (torch.Tensor.__matmul__, meta(5, 4), meta(4, 2)),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_results_are_pytorchs_own(case):
    func, *args = CASES[case]
    kwargs = {"inplace": False} if func is F.silu else {}
    got = _made(func, *args, **kwargs)
    expected = func(*args, **kwargs)
    assert got is not None
    assert (got.shape, got.dtype, got.device) == (
        expected.shape,
        expected.dtype,
        expected.device,
    )
    assert got.is_contiguous() and expected.is_contiguous()


def test_cat_keyword_dim_and_linear_keyword_bias():
    got = _made(torch.cat, [meta(2, 3), meta(2, 1)], dim=1)
    assert got.shape == torch.cat([meta(2, 3), meta(2, 1)], dim=1).shape == (2, 4)
    got = _made(F.linear, meta(3, 4), meta(5, 4), bias=meta(5))
    assert got.shape == (3, 5)


def test_none_where_it_cannot_say():
    x = meta(2, 3)
    channels_last = meta(1, 3, 4, 4).to(memory_format=torch.channels_last)
    refused = [
        (torch.Tensor.add_, x, x),  # in place
        (torch.Tensor.__iadd__, x, x),
        (F.silu, x),  # inplace given as True below
        (torch.cat, [meta(2, 3), meta(2, 3, dtype=torch.float16)]),  # promoted
        (torch.cat, [channels_last, channels_last], 1),  # kept channels-last
        (torch.cat, [x, meta(3, 3)], 1),  # shapes that do not fit: torch raises
        (F.linear, meta(2, 4), meta(5, 3)),
        (F.linear, meta(2, 4, dtype=torch.float16), meta(5, 4)),
        (torch.matmul, meta(4), meta(4, 2)),  # a vector
        (torch.Tensor.__rmatmul__, meta(4, 2), meta(5, 4)),
        (torch.add, torch.empty(2, 3), 1.0),  # not meta
        (torch.add, meta(2, 3, dtype=torch.int64), 1),  # not floating
        (torch.Tensor.sum, x),  # not made here
    ]
    for func, *args in refused:
        kwargs = {"inplace": True} if func is F.silu else {}
        assert _made(func, *args, **kwargs) is None, func
    assert torch.cat([channels_last, channels_last], 1).is_contiguous(
        memory_format=torch.channels_last
    )
