"""torchpm's custom ops (``torch.ops.torchpm``) with their Python front ends."""

from .cic import cic_paint, cic_readout
from ._reference import cic_paint_reference, cic_readout_reference

__all__ = ["cic_paint", "cic_readout", "cic_paint_reference", "cic_readout_reference"]
