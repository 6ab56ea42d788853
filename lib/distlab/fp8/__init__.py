"""FP8: the two formats, the ways of scaling a tensor into one, and the rule that keeps a
sharded cast equal to the unsharded cast.

Formats (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"): **E4M3**
(``torch.float8_e4m3fn``: 4 exponent bits, 3 mantissa bits, no infinity, largest 448) for
what needs precision (activations, weights), **E5M2** (``torch.float8_e5m2``: 5 and 2, the
IEEE layout, largest 57344) for what needs range (gradients). :func:`describe` reads
their range and precision from ``torch.finfo`` and :func:`sqnr` measures a cast's error
(:mod:`~distlab.fp8.formats`).

Scaling. A tensor x goes to format f as ``q = cast(x · s)``, saturated at ±max_f, and
comes back as ``q / s``. The scale ``s = max_f / amax`` puts the largest magnitude
``amax`` on the format's largest value, so the tensor uses the whole range. Where amax
comes from is the recipe:

* **tensorwise dynamic** (:func:`quantize`, ``rowwise=False``): the amax of this tensor
  now, one scale per tensor (torchao's ``tensorwise`` recipe);
* **rowwise** (``rowwise=True``): one amax, so one scale, per row (torchao's ``rowwise``),
  so an outlier costs only its own row its precision;
* **delayed** (:class:`DelayedScaling`): the largest amax of the last ``history``
  calls, known before the tensor is (Transformer Engine's recipe): no pass over the
  tensor before the cast, but a tensor that outgrows its history saturates.

Sharding. When a tensor is split over a group of ranks (a batch over data-parallel
ranks, a sequence over context-parallel ones), each rank sees only its shard's amax.
Cast with that, the shards use different scales, and the sharded tensor is not the one
process's tensor cast. All-reduced with MAX over the group first (``group=``), every
rank uses the whole tensor's amax, and the sharded cast equals the unsharded one bit
for bit: a cast is elementwise once the scale is fixed.

Finer groups: :mod:`~distlab.fp8.groups` gives any ``rows x cols`` grouping one scale per
group (DeepSeek-V3's 1x128 activation tiles and 128x128 weight blocks), as a rowwise cast
of the groups. The accumulator: :mod:`~distlab.fp8.accumulate` emulates a matrix
product's sum kept to about 14 bits, as DeepSeek-V3 measured on H800 GPUs, and its fix,
promotion to float32 every 128 elements.

The casts (:mod:`~distlab.fp8.scaling`) are lab 10's exercise ``fp8_linear``: that module
holds only answers.
"""
from distlab.fp8.formats import AMAX_FLOOR, FORMATS, describe, dtype_of, sqnr
from distlab.fp8.scaling import (DelayedScaling, amax, cast, dequantize, quantize, round_trip,
                                 scale_for)

__all__ = ["AMAX_FLOOR", "FORMATS", "DelayedScaling", "amax", "cast", "dequantize", "describe",
           "dtype_of", "quantize", "round_trip", "scale_for", "sqnr"]
