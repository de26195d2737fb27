"""The model-family registry: config.json `architectures[0]` -> the family module that reads it.

Every module or package in this folder that defines `FAMILY` is a family (the interface is
`base.Family`) and is registered here when this package is imported; nothing else lists them.
"""

import importlib
import pkgutil

from tandem.checkpoint.families.base import Family


def _discover() -> list[Family]:
    found = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(module, "FAMILY"):
            found.append(module)
    return found


FAMILY_MODULES: dict[str, Family] = {module.FAMILY: module for module in _discover()}
FAMILIES: dict[str, Family] = {arch: module for module in FAMILY_MODULES.values() for arch in module.ARCHITECTURES}
# model_type -> architecture, for configs without an `architectures` list
MODEL_TYPES = {spec[0]: arch for arch, module in FAMILIES.items() for spec in [module.ARCHITECTURES[arch]]}
