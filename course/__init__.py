"""The course's host code, in four parts; each imports only the parts listed before it
(tests/test_course.py checks it):

- ``course.runtime``: what a kernel file imports: validation, compiling, launching, the prefill
  host function, KV-cache and shape helpers, and the registry of stage files.
- ``course.testing``: the yardstick the checks use: random inputs, the float64 reference, error
  reports, the tile models of the CPU checks, and each stage file's demo.
- ``course.integration``: the kernels inside PyTorch (``course.integration.ops``, custom ops) and
  transformers (``course.integration.models``, an attention backend).
- ``course.tools``: the command line (``python -m course``), skeletons, diffs, transcripts,
  notebooks, benchmarks and their result pages, SASS listings, the sanitizer.

The names of before this layout (``import course.models``, ``course.ops``, ``from course import
launch, prefill``, ``course.kv_cache.quantize_kv_cache``) still import, as the same module
objects, so a stage file a learner started earlier, or a model author's script, keeps working.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

# The modules that moved into a part: old name -> part.
MOVED = {
    **dict.fromkeys(("compile", "kv_cache", "launch", "prefill", "shapes", "stages", "validation"), "runtime"),
    **dict.fromkeys(("reference", "tile_models"), "testing"),
    **dict.fromkeys(("ops", "models"), "integration"),
    **dict.fromkeys(("bench", "cli", "constraints", "diffs", "host_bench", "model_bench", "notebooks", "results",
                     "sanitize", "sass", "skeleton", "transcripts"), "tools"),
}


class _OldNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``course.<old name>`` as the module ``course.<part>.<old name>`` itself (not a copy)."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.partition(".")
        if package == __name__ and name in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        name = spec.name.partition(".")[2]
        module = importlib.import_module(f"{__name__}.{MOVED[name]}.{name}")
        spec.loader_state = module.__spec__  # the import system gives the module this spec next
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state  # it keeps its own


if not any(isinstance(finder, _OldNames) for finder in sys.meta_path):
    sys.meta_path.append(_OldNames())
