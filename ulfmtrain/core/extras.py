"""The optional `tools` extra (matplotlib, scikit-learn, tqdm): imported only where used, missing said plainly."""
from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, purpose: str) -> ModuleType:
    """Import `module` of the tools extra, or raise ImportError naming what needs it and the fix."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"{purpose} needs {module.split('.')[0]}, part of the tools extra: "
                          "pip install 'ulfmtrain[tools]'") from None
