"""torchpm's custom ops (``torch.ops.torchpm``) with their Python front ends."""

from .error_checking import check, get_error_checking, set_error_checking
from .mass_assignment import (
    cic_paint,
    cic_readout,
    get_paint_method,
    halo_widths,
    paint,
    readout,
    set_paint_method,
)
from .finite_difference import fd4_gradient, fd4_gradient_transpose
from . import updates as _updates  # noqa: F401  (registers the fake kernel and autograd)
from ._reference import (
    cic_paint_reference,
    cic_readout_reference,
    paint_reference,
    position_gradient_reference,
    readout_reference,
)

__all__ = [
    "check",
    "set_error_checking",
    "get_error_checking",
    "paint",
    "readout",
    "cic_paint",
    "cic_readout",
    "halo_widths",
    "set_paint_method",
    "get_paint_method",
    "fd4_gradient",
    "fd4_gradient_transpose",
    "paint_reference",
    "readout_reference",
    "position_gradient_reference",
    "cic_paint_reference",
    "cic_readout_reference",
]

from . import _vmap as _vmap_rules

_vmap_rules.register()
