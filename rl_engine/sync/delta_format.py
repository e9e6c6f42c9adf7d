"""The delta format of `rl_engine.sync.delta`: what changed between two versions of the weights, exactly.

Per changed tensor (name `<name>`, flat elements, their bits as integers of the dtype's width),
either `::all` or positions and differences, with exceptions where some do not fit:

    <name>::all                      the whole tensor (when that is smallest)
    <name>::idx  or  <name>::mask    the changed elements' flat positions: int32 (int64 past 2^31
                                     elements), or one packed bit per element
    <name>::dbits                    per changed element, new bits - old bits wrapping in the dtype's
                                     width, narrowed to the smallest signed integer that is cheapest
                                     overall (int8 when it fits: a one-ulp bfloat16 step is +-1)
    <name>::xidx + <name>::xval      the changed elements whose difference does not fit `dbits`
                                     (their `dbits` is 0): flat positions and their new values

Applying adds the differences to the held bits (wrapping) and writes the `xval`s over them, so a
chain gives the trainer's tensors bit for bit (sign flips, NaN and inf patterns included). Format
1 (`::val`: the new values instead of `::dbits`) is still applied. `pack` writes the entries as
one safetensors file compressed with zstd (level 1); the packed mask is mostly zeros and the +-1
differences are low in entropy.

    delta = diff(old, new)                 # {entry: tensor}; None when the layouts differ
    data, raw = pack(delta)                # zstd(safetensors bytes), len(safetensors bytes)
    apply(held, unpack(data, raw))         # in place; ValueError with nothing changed if it does not fit
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

FORMAT = 2  # 1: delta.safetensors with ::val; 2: delta.safetensors.zst with ::dbits (+ ::xidx/::xval)
SEP = "::"
ZSTD_LEVEL = 1  # 100M bfloat16 elements, 12% moved an ulp: 9.2 MB in 0.15 s, level 3 9.7 MB in 0.27 s
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_DIFFS = {torch.int8: 1, torch.int16: 2, torch.int32: 4, torch.int64: 8}  # `dbits` dtype -> width
CHUNK = 1 << 20  # elements per pass of encode and apply (cache-sized temporaries; a multiple of 8)
_ENTRIES = ("all", "idx", "mask", "dbits", "val", "xidx", "xval")


def _bits(t: torch.Tensor) -> np.ndarray:
    """The flat bits of a contiguous CPU tensor as a signed numpy integer array sharing its memory
    (numpy: the compare, count and scatter of 100M elements take tens of ms, torch's boolean ops seconds)."""
    return t.reshape(-1).view(_BITS[t.element_size()]).numpy()


def encode(name: str, old: torch.Tensor, new: torch.Tensor) -> dict[str, torch.Tensor]:
    """The entries of tensor `name` in a delta from `old` to `new` (same shape and dtype, CPU, contiguous): none if no bit changed."""
    bits, base = _bits(new), _bits(old)
    n, e = bits.size, new.element_size()
    ranges = {w: np.iinfo(f"int{8 * w}") for w in (1, 2, 4) if w < e}
    chunks = []  # per CHUNK elements: (start, packed mask, differences of the changed ones, {w: how many do not fit int w})
    for s in range(0, n, CHUNK):
        dense = bits[s : s + CHUNK] - base[s : s + CHUNK]  # wraps in the dtype's width
        changed = dense != 0
        d = np.compress(changed, dense)
        chunks.append(
            (
                s,
                np.packbits(changed),
                d,
                {w: int(np.count_nonzero((d < r.min) | (d > r.max))) for w, r in ranges.items()},
            )
        )
    k = sum(c[2].size for c in chunks)
    if k == 0:
        return {}
    wide = n > np.iinfo(np.int32).max
    itype, iw = (np.int64, 8) if wide else (np.int32, 4)
    costs = {e: k * e} | {
        w: k * w + sum(c[3][w] for c in chunks) * (iw + e) for w in ranges
    }  # differences + exceptions
    width = min(costs, key=costs.__getitem__)
    where = {"idx": k * iw, "mask": (n + 7) // 8}
    how = min(where, key=where.__getitem__)
    if where[how] + costs[width] >= n * e:
        return {f"{name}{SEP}all": new}

    def positions(c: tuple[Any, ...], which: np.ndarray | None = None) -> np.ndarray:
        p = np.flatnonzero(np.unpackbits(c[1], count=min(CHUNK, n - c[0])))
        return (p if which is None else p[which]).astype(itype) + c[0]

    if how == "idx":
        out = {f"{name}{SEP}idx": torch.from_numpy(np.concatenate([positions(c) for c in chunks]))}
    else:
        out = {f"{name}{SEP}mask": torch.from_numpy(np.concatenate([c[1] for c in chunks]))}  # CHUNK is a multiple of 8
    d = np.concatenate([c[2] for c in chunks])
    if width < e and costs[width] > k * width:
        r = ranges[width]
        x = np.concatenate([positions(c, (c[2] < r.min) | (c[2] > r.max)) for c in chunks if c[3][width]])
        out[f"{name}{SEP}xidx"], out[f"{name}{SEP}xval"] = (
            torch.from_numpy(x),
            torch.from_numpy(bits[x]).view(new.dtype),
        )
        d[(d < r.min) | (d > r.max)] = 0
    out[f"{name}{SEP}dbits"] = torch.from_numpy(
        d.astype(f"int{8 * width}")
    )  # keeps the low bits: the wrapped difference
    return out


def diff(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The delta from `old` to `new` (every tensor's `encode`); None when their names, shapes or dtypes differ (publish a full one)."""
    if old.keys() != new.keys() or any(old[k].shape != t.shape or old[k].dtype != t.dtype for k, t in new.items()):
        return None
    out: dict[str, torch.Tensor] = {}
    for name, t in new.items():
        out.update(encode(name, old[name], t))
    return out


def _positions(name: str, key: str, part: torch.Tensor, n: int) -> np.ndarray:
    if part.dtype not in (torch.int32, torch.int64) or part.dim() != 1:
        raise ValueError(f"entry {name}{SEP}{key} ({part.dtype}, {tuple(part.shape)}) is not a list of positions")
    where = part.numpy()
    if where.size and (int(where.min()) < 0 or int(where.max()) >= n):
        raise ValueError(f"the positions {name}{SEP}{key} do not fit its {n} elements")
    return where


def _plan(name: str, t: torch.Tensor | None, p: dict[str, torch.Tensor]) -> tuple[Any, ...]:
    """(tensor, positions or None for all, values or differences, is differences, outlier positions, outlier values): `p`'s entries checked against `t`."""
    if t is None:
        raise ValueError(f"it changes {name!r}, which its base does not have")
    if "all" in p:
        a = p["all"]
        if len(p) != 1 or a.shape != t.shape or a.dtype != t.dtype:
            raise ValueError(
                f"{name!r} is {tuple(a.shape)} {a.dtype} in it (with {sorted(p)}), {tuple(t.shape)} {t.dtype} in its base"
            )
        return t, None, a, False, None, None
    if ("idx" in p) == ("mask" in p) or ("dbits" in p) == ("val" in p) or ("xidx" in p) != ("xval" in p):
        raise ValueError(
            f"{name!r} has entries {sorted(p)}: not positions (idx or mask), values (dbits or val) and optional xidx + xval"
        )
    n = t.numel()
    if "idx" in p:
        where = _positions(name, "idx", p["idx"], n)
        count = where.size
    elif (
        p["mask"].dtype == torch.uint8
        and p["mask"].dim() == 1
        and p["mask"].numel() == (n + 7) // 8
        and not p["mask"][-1] & ((1 << (-n % 8)) - 1)
    ):
        where = p["mask"].numpy()  # packed: its padding bits are zero
        count = int(np.bitwise_count(where).sum())
    else:
        raise ValueError(
            f"entry {name}{SEP}mask ({p['mask'].dtype}, {tuple(p['mask'].shape)}) is no packed mask of {n} elements"
        )
    is_diff = "dbits" in p
    values = p["dbits"] if is_diff else p["val"]
    fits = _DIFFS.get(values.dtype, 99) <= t.element_size() if is_diff else values.dtype == t.dtype
    if not fits or values.dim() != 1 or values.numel() != count:
        raise ValueError(
            f"the values of {name!r} ({values.numel()} of {values.dtype}) do not fit its {count} changed elements of {t.dtype}"
        )
    xidx = xval = None
    if "xidx" in p:
        xidx, xval = _positions(name, "xidx", p["xidx"], n), p["xval"]
        if xval.dtype != t.dtype or xval.numel() != xidx.size:
            raise ValueError(
                f"the exceptions of {name!r} ({xidx.size} positions, {xval.numel()} of {xval.dtype}) do not fit {t.dtype}"
            )
    return t, where, values, is_diff, xidx, xval


def apply(held: dict[str, torch.Tensor], delta: dict[str, torch.Tensor]) -> None:
    """Write a delta (`diff`'s entries, or format 1's) into the `held` tensors in place. Every entry
    is checked against its tensor first: one that does not fit raises ValueError with nothing changed."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, part in delta.items():
        name, how = key.rsplit(SEP, 1) if SEP in key else (key, "")
        if how not in _ENTRIES:
            raise ValueError(f"entry {key!r} ({part.dtype}, {tuple(part.shape)}) is not a delta entry")
        parts.setdefault(name, {})[how] = part
    plans = [_plan(name, held.get(name), p) for name, p in parts.items()]
    for t, where, values, is_diff, xidx, xval in plans:
        b = _bits(t)
        if where is None:
            t.copy_(values)
        elif where.dtype == np.uint8:  # a packed mask
            _apply_masked(b, where, values.numpy() if is_diff else _bits(values), is_diff)
        elif is_diff:
            b[where] += values.numpy().astype(b.dtype)  # positions are unique; int + int wraps in b's width
        else:
            b[where] = _bits(values)
        if xidx is not None:
            b[xidx] = _bits(xval)


def _apply_masked(b: np.ndarray, packed: np.ndarray, values: np.ndarray, is_diff: bool) -> None:
    """Add the differences (or write the values) at the set bits of `packed` into `b`, CHUNK elements
    at a time (cache-sized: a dense add of the spread differences beats a gather and a scatter)."""
    i = 0
    for s in range(0, b.size, CHUNK):
        seg = b[s : s + CHUNK]
        mask = np.unpackbits(packed[s // 8 : (s + CHUNK) // 8], count=seg.size).view(bool)
        k = int(np.count_nonzero(mask))
        if not k:
            continue
        if is_diff:
            spread = np.zeros(seg.size, values.dtype)
            spread[mask] = values[i : i + k]
            np.add(seg, spread, out=seg)  # wraps in b's width
        else:
            seg[mask] = values[i : i + k]
        i += k


def payload_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def pack(delta: dict[str, torch.Tensor]) -> tuple[bytes, int]:
    """(the delta as a zstd-compressed safetensors file, the uncompressed file's size)."""
    import pyarrow as pa
    from safetensors.torch import save

    raw = save(delta, metadata={"format": "pt"})
    return pa.Codec("zstd", compression_level=ZSTD_LEVEL).compress(raw, asbytes=True), len(raw)


def unpack(data: bytes, raw_bytes: int) -> dict[str, torch.Tensor]:
    """`pack`'s tensors back from its bytes (`raw_bytes`: the uncompressed size its marker records)."""
    import pyarrow as pa
    from safetensors.torch import load

    return load(pa.Codec("zstd").decompress(data, decompressed_size=raw_bytes, asbytes=True))
