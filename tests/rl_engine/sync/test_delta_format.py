"""The delta format (rl_engine/sync/delta_format.py): the entries each tensor gets, bit-exact round
trips through the differences of the bit patterns (wrapping, narrowed to int8 where they fit,
exceptions and wider integers where not), format 1 still applied, what `apply` refuses, and the
packed size of a bfloat16 step with a known fraction of changed elements.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/rl_engine/sync/test_delta_format.py -x -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rl_engine.sync.delta_format import CHUNK, apply, diff, pack, payload_bytes, unpack


def bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    same = lambda x, y: (
        x.dtype == y.dtype
        and x.shape == y.shape
        and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
    )  # noqa: E731
    return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)


def from_bits(values: list[int], dtype: torch.dtype, n: int, fill: int = 0x3F80) -> torch.Tensor:
    """A tensor of `n` elements of `dtype` whose first elements have the bit patterns `values` (unsigned), the rest `fill`."""
    width = {torch.bfloat16: 16, torch.float32: 32}[dtype]
    signed = [v - (1 << width) if v >= 1 << (width - 1) else v for v in [*values, *[fill] * (n - len(values))]]
    return torch.tensor(signed, dtype={16: torch.int16, 32: torch.int32}[width]).view(dtype)


def round_trip(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The delta from `old` to `new`, after checking that it (and its packed file) rebuilds `new` bit for bit."""
    delta = diff(old, new)
    assert delta is not None
    for entries in (delta, unpack(*pack(delta))):
        held = {k: t.clone() for k, t in old.items()}
        apply(held, entries)
        assert bits_equal(held, new)
    return delta


def test_bfloat16_differences_of_the_bits_wrap_and_narrow_to_int8():
    #          1.0 up   1.0 down  NaN->+0  +0->NaN  inf->NaN max->inf  +0->-0 (sign)
    old_bits = [0x3F80, 0x3F80, 0xFFFF, 0x0000, 0x7F80, 0x7F7F, 0x0000]
    new_bits = [0x3F81, 0x3F7F, 0x0000, 0xFFFF, 0x7FC0, 0x7F80, 0x8000]
    old, new = {"t": from_bits(old_bits, torch.bfloat16, 64)}, {"t": from_bits(new_bits, torch.bfloat16, 64)}
    delta = round_trip(old, new)
    # 7 of 64 changed: a mask (8 bytes) beats int32 positions (28); int8 differences (7) plus the one
    # that does not fit as an exception (4 + 2) beat int16 ones (14).
    assert sorted(delta) == ["t::dbits", "t::mask", "t::xidx", "t::xval"]
    assert delta["t::mask"].tolist() == [0b11111110, 0, 0, 0, 0, 0, 0, 0]
    assert delta["t::dbits"].dtype == torch.int8 and delta["t::dbits"].tolist() == [
        1,
        -1,
        1,
        -1,
        64,
        1,
        0,
    ]  # 0x0000 - 0xFFFF wraps to +1
    assert delta["t::xidx"].tolist() == [6] and delta["t::xval"].view(torch.int16).tolist() == [-0x8000]  # -0.0
    assert payload_bytes(delta.values()) == 8 + 7 + 4 + 2


def test_differences_that_do_not_fit_int8_go_wider():
    # +0 -> -0 in 8 of 64 bfloat16 elements: each difference is -32768; int8 plus 8 exceptions (7 + 8 * 6) costs more than int16 (16).
    flips = {"t": from_bits([0x0000] * 8, torch.bfloat16, 64)}
    delta = round_trip(flips, {"t": from_bits([0x8000] * 8, torch.bfloat16, 64)})
    assert (
        sorted(delta) == ["t::dbits", "t::mask"]
        and delta["t::dbits"].dtype == torch.int16
        and delta["t::dbits"].tolist() == [-32768] * 8
    )
    # float32: NaN 0x7FFFFFFF -> -0.0 0x80000000 is +1 in 32 bits (one position: int32 index 4 beats the 8-byte mask);
    # 0x3F800000 -> 0x3F810000 is +65536, int32.
    old = {
        "one": from_bits([0, 0x7FFFFFFF], torch.float32, 64, fill=0),
        "wide": from_bits([0x3F800000], torch.float32, 64, fill=0),
    }
    new = {
        "one": from_bits([0, 0x80000000], torch.float32, 64, fill=0),
        "wide": from_bits([0x3F810000], torch.float32, 64, fill=0),
    }
    delta = round_trip(old, new)
    assert sorted(delta) == ["one::dbits", "one::idx", "wide::dbits", "wide::idx"]
    assert (
        delta["one::idx"].tolist() == [1]
        and delta["one::dbits"].dtype == torch.int8
        and delta["one::dbits"].tolist() == [1]
    )
    assert delta["wide::dbits"].dtype == torch.int32 and delta["wide::dbits"].tolist() == [65536]


def test_whole_unchanged_and_relaid_tensors():
    g = torch.Generator().manual_seed(1)
    old = {"all": torch.randn(64, generator=g), "same": torch.randn(5, generator=g), "count": torch.arange(3)}
    new = {"all": old["all"] + 1.0, "same": old["same"].clone(), "count": torch.tensor([0, 1, 7])}
    delta = round_trip(old, new)
    assert sorted(delta) == ["all::all", "count::dbits", "count::mask"] and delta["count::dbits"].tolist() == [
        5
    ]  # int64 2 -> 7: +5, in int8
    assert (
        diff(old, {**new, "extra": torch.zeros(1)}) is None and diff(old, {**new, "all": torch.zeros(65)}) is None
    )  # another layout: full


def test_a_tensor_larger_than_a_chunk_round_trips():
    """Encode and apply go CHUNK elements at a time: changes on both sides of a chunk's edge, the last chunk short."""
    n = 2 * CHUNK + 13
    old = {"w": torch.randn(n, generator=torch.Generator().manual_seed(2)).bfloat16()}
    bits = old["w"].view(torch.int16).clone()
    at = [0, CHUNK - 1, CHUNK, CHUNK + 1, CHUNK + 2, 2 * CHUNK + 12]
    bits[at] += 1
    bits[5] ^= -0x8000  # a sign flip: an exception
    delta = round_trip(old, {"w": bits.view(torch.bfloat16)})
    assert (
        delta["w::idx"].tolist() == sorted([*at, 5])
        and delta["w::xidx"].tolist() == [5]
        and delta["w::dbits"].dtype == torch.int8
    )
    many = old["w"].view(torch.int16) + (torch.arange(n) % 3 == 0).to(torch.int16)  # a third of them, one ulp: a mask
    many[[7, CHUNK + 7]] ^= -0x8000
    delta = round_trip(old, {"w": many.view(torch.bfloat16)})
    assert sorted(delta) == ["w::dbits", "w::mask", "w::xidx", "w::xval"] and delta["w::xidx"].tolist() == [
        7,
        CHUNK + 7,
    ]


def test_format_1_values_still_apply():
    held = {"a": torch.zeros(10), "b": torch.zeros(16, dtype=torch.bfloat16)}
    mask = torch.from_numpy(np.packbits(np.arange(16) % 4 == 0))
    apply(
        held,
        {
            "a::idx": torch.tensor([1, 9], dtype=torch.int32),
            "a::val": torch.tensor([2.0, -0.0]),
            "b::mask": mask,
            "b::val": torch.ones(4, dtype=torch.bfloat16),
        },
    )
    assert held["a"].tolist() == [0, 2, 0, 0, 0, 0, 0, 0, 0, 0] and torch.signbit(held["a"][9])
    assert held["b"].float().tolist() == [1, 0, 0, 0] * 4


def test_a_delta_that_does_not_fit_changes_nothing():
    held = {"a": torch.zeros(10), "b": torch.zeros(4, dtype=torch.bfloat16)}
    idx = torch.tensor([1], dtype=torch.int32)
    for bad in (
        {
            "a::idx": torch.tensor([1, 10], dtype=torch.int32),
            "a::dbits": torch.ones(2, dtype=torch.int8),
        },  # a position past the end
        {
            "b::all": torch.ones(4, dtype=torch.bfloat16),
            "a::idx": idx,
            "a::dbits": torch.ones(2, dtype=torch.int8),
        },  # 2 differences, 1 position
        {"c::all": torch.ones(1)},  # a tensor its base does not have
        {"b::idx": idx, "b::dbits": torch.ones(1, dtype=torch.int32)},  # differences wider than bfloat16
        {
            "b::mask": torch.tensor([0b10000001], dtype=torch.uint8),
            "b::dbits": torch.ones(2, dtype=torch.int8),
        },  # a padding bit set
        {"a::idx": idx, "a::dbits": torch.ones(1, dtype=torch.int8), "a::xidx": idx},  # exceptions without values
        {"a::idx": idx, "a::dbits": torch.ones(1, dtype=torch.int8), "a::val": torch.ones(1)},  # differences and values
        {"a::dbits": torch.ones(1, dtype=torch.int8)},  # no positions
        {"a::what": torch.ones(1)},
    ):
        with pytest.raises(ValueError):
            apply(held, bad)
        assert held["a"].sum() == 0 and held["b"].float().sum() == 0


def test_a_bfloat16_step_that_moves_a_tenth_of_the_elements_packs_under_a_tenth():
    """10% of 2^20 bfloat16 elements move one ulp up or down: a mask (n / 8 bytes) and int8
    differences (n / 10) are (1/8 + 1/10) / 2 = 11.25% of the tensor's bytes before zstd; the mask
    at 10% density and the signs carry 0.57 bits per element (3.6%), and zstd gets under 6%."""
    n, g = 1 << 20, torch.Generator().manual_seed(3)
    old = torch.randn(n, generator=g).bfloat16()
    bits = old.view(torch.int16).clone()
    moved = torch.randperm(n, generator=g)[: n // 10]
    bits[moved] += torch.where(torch.rand(n // 10, generator=g) < 0.5, 1, -1).to(torch.int16)
    delta = round_trip({"w": old}, {"w": bits.view(torch.bfloat16)})
    assert sorted(delta) == ["w::dbits", "w::mask"]  # one ulp never leaves int8 (no exceptions)
    assert payload_bytes(delta.values()) == n // 8 + n // 10
    data, raw = pack(delta)
    assert raw > payload_bytes(delta.values()) and len(data) < 0.06 * 2 * n
