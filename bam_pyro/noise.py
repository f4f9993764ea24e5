"""Counter-based attention noise: every draw is a pure function of (seed, batch, head, query, key).

The fused path (:mod:`bam_pyro.fused`) stores no large attention map, so it cannot store the noise
of one either: its backward pass draws the noise again, chunk by chunk. A stateful generator
(``torch.rand``) cannot do that cheaply; a hash of the entry's coordinates can, in any order and
any chunking, on any device, inside a compiled graph (random ops under ``torch.compile`` may be
recomputed with fresh randomness; a hash is not random to the compiler) and inside a
FlexAttention ``score_mod``.

The hash is Chris Wellons' ``lowbias32`` integer finalizer on int32 tensors: products wrap modulo
2**32 in C++, CUDA and Triton alike, and right shifts are made logical by masking, so every
backend computes the same bits. One exception, found under ``torch.compile`` on CPU (torch 2.13):
from indices made by an ``arange`` inside the graph, Inductor's C++ knows their range, and the C++
compiler, for which signed overflow cannot happen, rewrote the wrapping products. Indices that
enter the hash therefore come from :func:`counters`, an operator the compiler does not see into.
Per call:

- ``row_keys(seeds, batch_size, heads)``: one 32-bit key per (draw, batch item, head), mixed from
  the call's seed(s): ``[N, H]`` with N = draws x batch items;
- ``query_keys(row_keys, queries)``: one key per query row, ``[N, H, Lq]`` (small);
- ``entry_bits(query_key, key_index, stream)``: the 32 bits of one entry, the only full-size
  step. ``stream`` separates independent draws of one entry (the attention noise, the dropout
  mask).

Uniforms have 24 bits, ``u = (bits >> 8 + 0.5) / 2**24`` in (0, 1): the Weibull noise ``log(-log u)``
then lies in [-16.6, 2.8] and the Gaussian ``sqrt(2) erfinv(2u - 1)`` in [-5.3, 5.3], cut where
the exact laws put less than 1e-7 of their mass.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor


@torch.library.custom_op("bam_pyro::counters", mutates_args=())
def counters(start: int, stop: int, device: torch.device) -> Tensor:
    """``arange(start, stop)`` in int32, as an operator ``torch.compile`` calls without seeing into
    it, so that the hash of the indices is compiled as written (module doc)."""
    return torch.arange(start, stop, dtype=torch.int32, device=device)


@counters.register_fake
def _(start, stop, device):
    return torch.empty(stop - start, dtype=torch.int32, device=device)


def _signed32(value: int) -> int:
    """A 32-bit word as the int32 that holds the same bits."""
    value &= 0xFFFFFFFF
    return value - 2**32 if value >= 2**31 else value


_GOLDEN = _signed32(0x9E3779B9)  # odd multiplier that spreads consecutive counters over the 32 bits
_M1, _M2 = _signed32(0x7FEB352D), _signed32(0x846CA68B)
#: streams of independent noise of the same entries
NOISE_STREAM = 0
DROPOUT_STREAM = _signed32(0x5BD1E995)


def _shr(x: Tensor, n: int, out: Optional[Tensor] = None) -> Tensor:
    """Logical right shift of int32 words (torch shifts signed integers arithmetically), into
    ``out`` if given."""
    return torch.bitwise_right_shift(x, n, out=out).bitwise_and_((1 << (32 - n)) - 1)


def mix32(x: Tensor, inplace: bool = False) -> Tensor:
    """lowbias32 finalizer of int32 words (a bijection of 32-bit words). ``inplace=True`` overwrites
    ``x`` and shifts into one scratch tensor: the same bits with one full-size allocation instead of
    one per operation, which on CPU cost as much as the arithmetic (each fresh multi-megabyte tensor
    is fresh pages). Out of place for FlexAttention's ``score_mod``."""
    scratch = torch.empty_like(x) if inplace else None

    def xorshift(x: Tensor, n: int) -> Tensor:
        return x.bitwise_xor_(_shr(x, n, scratch)) if inplace else x ^ _shr(x, n)

    def times(x: Tensor, m: int) -> Tensor:
        return x.mul_(m) if inplace else x * m

    x = times(xorshift(x, 16), _M1)
    x = times(xorshift(x, 15), _M2)
    return xorshift(x, 16)


def _int32(x: Tensor) -> Tensor:
    """The low 32 bits of int64 ``x`` as int32."""
    return (((x & 0xFFFFFFFF) + 2**31) & 0xFFFFFFFF).sub(2**31).to(torch.int32)


def row_keys(seeds: Tensor, batch_size: int, heads: int) -> Tensor:
    """Keys ``[N, H]`` int32 of each (draw, batch item, head): ``seeds`` (int64, shape ``[draws]``
    or ``[]``) are the draws' seeds, N = draws x ``batch_size`` (draw-major)."""
    seeds = seeds.reshape(-1).to(torch.int64).repeat_interleave(batch_size)
    device = seeds.device
    item = counters(0, batch_size, device).repeat(seeds.numel() // max(batch_size, 1))
    key = mix32(mix32(_int32(seeds) + _GOLDEN) ^ _int32(seeds >> 32))
    key = mix32(key + item * _GOLDEN)
    head = counters(0, heads, device)
    return mix32(key[:, None] + head * _GOLDEN)


def query_keys(keys: Tensor, queries: Tensor) -> Tensor:
    """Per-row keys ``[N, H, len(queries)]`` int32 from row keys ``[N, H]`` and query indices."""
    return mix32(keys[..., None] ^ mix32(queries.to(torch.int32) + 0x632BE5AB))


def entry_bits(query_key: Tensor, key_index: Tensor, stream: int = NOISE_STREAM, inplace: bool = False) -> Tensor:
    """32 random bits per entry (int32), from broadcastable query keys and key indices
    (``inplace``: hash the fresh sum in place, see :func:`mix32`)."""
    return mix32(query_key + (key_index.to(torch.int32) + stream) * _GOLDEN, inplace)


def uniform(bits: Tensor, dtype: torch.dtype = torch.float32, inplace: bool = False) -> Tensor:
    """Uniform in (0, 1), 24 bits of resolution: a new tensor, or with ``inplace`` (eager CPU,
    float32) ``bits``' own memory seen as floats (``bits`` is then spent: on CPU a fresh map-sized tensor
    costs more than its arithmetic, its pages faulted in anew). The top draw, ``2**24 - 1 + 0.5``,
    is no float32 and rounds to ``2**24``, which would make u exactly 1 (a Gaussian of +inf, a
    Weibull noise of -inf: NaN weights under the Lognormal, a weight of 0 under the Weibull, once
    in 2**24 entries): it is clamped to the largest float below 1."""
    if inplace and bits.is_cpu and dtype.itemsize == bits.itemsize and not torch.compiler.is_compiling():
        words = _shr(bits, 8, out=bits)
        floats = words.view(dtype).copy_(words)  # each word converted where it lies
    else:
        floats = _shr(bits, 8).to(dtype)
    return floats.add_(0.5).mul_(1.0 / 2**24).clamp_(max=1.0 - torch.finfo(dtype).eps / 2)


def gumbel_like(bits: Tensor, dtype: torch.dtype = torch.float32, inplace: bool = False) -> Tensor:
    """``log(-log u)``: log of a unit exponential, the Weibull noise ``k * log(S / lam)``
    (``inplace``: see :func:`uniform`)."""
    return uniform(bits, dtype, inplace).log_().neg_().log_()


def gaussian(bits: Tensor, dtype: torch.dtype = torch.float32, inplace: bool = False) -> Tensor:
    """Standard normal by the inverse CDF, ``sqrt(2) erfinv(2u - 1)`` (``inplace``: see :func:`uniform`)."""
    return uniform(bits, dtype, inplace).mul_(2.0).sub_(1.0).erfinv_().mul_(math.sqrt(2.0))


def log_noise(bits: Tensor, family: str, k: float | Tensor, sigma: float | Tensor, dtype: torch.dtype = torch.float32,
              inplace: bool = False) -> Tensor:
    """What q adds to the scores before the softmax: ``g / k`` (Weibull, shape k) or
    ``sigma * eps`` (Lognormal, scale sigma); the constants that cancel in the softmax are left out
    (``inplace``: see :func:`uniform`)."""
    if family == "weibull":
        return gumbel_like(bits, dtype, inplace).div_(k)
    if family == "lognormal":
        return gaussian(bits, dtype, inplace).mul_(sigma)
    raise ValueError(f"no attention noise for family {family!r}")


def draw_seeds(shape: torch.Size = torch.Size(), device: Optional[torch.device] = None) -> Tensor:
    """Fresh int64 seeds from torch's generator (so ``pyro.set_rng_seed`` and a restored RNG
    state reproduce them), 62 bits each."""
    return torch.randint(0, 2**62, tuple(shape), dtype=torch.int64, device=device)


def noise_map(seeds: Tensor, shape: torch.Size, family: str, k: float = 1.0, sigma: float = 1.0,
              dtype: torch.dtype = torch.float32, stream: int = NOISE_STREAM) -> Tensor:
    """The whole noise ``[*draws, *batch, H, Lq, Lk]`` that the fused path draws chunk by chunk
    (``shape`` = ``[*batch, H, Lq, Lk]``, ``seeds`` ``[*draws]``): for tests and for the
    materialized maps that :mod:`bam_pyro.predictive` asks for. Costs a full map."""
    *batch, heads, lq, lk = shape
    n = math.prod(batch)
    keys = query_keys(row_keys(seeds, n, heads), counters(0, lq, seeds.device))
    bits = entry_bits(keys[..., None], counters(0, lk, seeds.device), stream)
    values = log_noise(bits, family, k, sigma, dtype) if stream == NOISE_STREAM else uniform(bits, dtype)
    return values.reshape(*seeds.shape, *shape)
