"""A module of another checkout of the repo (an older commit beside this tree), loaded under its
own name so that its kernels and this tree's can run side by side in one process."""
import importlib.util
import pathlib
from types import ModuleType


def load_base_module(directory: str, relative_path: str) -> ModuleType:
    """e.g. load_base_module(".base", "nanovllm/kernels/paged_attention.py")."""
    path = pathlib.Path(directory) / relative_path
    spec = importlib.util.spec_from_file_location(f"base_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
