"""The Megatron model families, one module each, found by ``model_type``.

Every module in this package that defines ``FAMILY`` (a ``ModelFamily``) is registered when the
package is imported, so adding a family is adding its module here; a family defined elsewhere
is added with ``register_family`` (in every process that converts: Megatron workers import only
this package).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from rl_models.megatron.family import ModelFamily

#: HF ``model_type`` -> its family.
FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    """Make ``family`` the one for each of its ``model_types`` (one family per type)."""
    for model_type in family.model_types:
        known = FAMILIES.get(model_type)
        if known is not None and known is not family:
            raise ValueError(
                f"model_type {model_type!r} already belongs to Megatron family {known.name!r}"
            )
    for model_type in family.model_types:
        FAMILIES[model_type] = family
    return family


def family_for(config: Any) -> ModelFamily:
    """The family of an HF config (or anything with a ``model_type``; none: Llama)."""
    model_type = getattr(config, "model_type", "llama")
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(
            f"no Megatron conversion for model_type {model_type!r} (known: {sorted(FAMILIES)})"
        )
    return family


for _module in pkgutil.iter_modules(__path__):
    _family = getattr(importlib.import_module(f"{__name__}.{_module.name}"), "FAMILY", None)
    if isinstance(_family, ModelFamily):
        register_family(_family)
