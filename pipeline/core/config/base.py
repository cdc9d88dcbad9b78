"""What every config section shares: frozen, keyword-only, and unknown keys refused."""

from __future__ import annotations

from typing import Annotated

import msgspec

__all__ = ["Positive", "PositiveFloat", "Section"]

Positive = Annotated[int, msgspec.Meta(gt=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]


class Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass
