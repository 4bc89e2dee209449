"""Imports every planted-bug module so that each registers its plants with paritykit.plants."""

import importlib

CATALOG_MODULES = (
    "paritykit.selftest.catalog_convert",
    "paritykit.selftest.catalog_cw",
    "paritykit.selftest.catalog_pipeline",
    "paritykit.selftest.catalog_sync",
)

for _module in CATALOG_MODULES:
    try:
        importlib.import_module(_module)
    except ModuleNotFoundError as _exc:
        if _exc.name != _module:
            raise
