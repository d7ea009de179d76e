"""The transformers releases this package is tested on, and what differs between them.

CI runs the suite on the dev pin and the routing, decoding, modeling and layout tests on the oldest
and the newest release (`requirements-dev.txt`, `-oldest.txt`, `-newest.txt`); `pyproject.toml` admits
exactly that range.
The routing wraps private `GenerationMixin` methods, which transformers changes between minor
releases, so a newer release is warned about at import and an older one refused.

What changed inside the range is read from transformers itself, not from its version number:
from 5.24 the KV cache is passed and returned as `cache` (before, `past_key_values`);
`ALL_CACHE_NAMES[0]` is the name `generate` itself uses. From 5.25 loading needs the `kernels`
package unless told otherwise (`LOAD_KWARGS`). (5.23's change to what an `output_hidden_states`
index means is in features.py; 5.25's removal of `_is_stateful` in generation.check_target.)
"""

from __future__ import annotations

import warnings

import transformers
from packaging.version import Version

OLDEST_TRANSFORMERS = "5.17.0"  # requirements-oldest.txt
NEWEST_TRANSFORMERS = "5.25.0"  # requirements-newest.txt; pyproject's bound is the next minor, exclusive


class UntestedTransformersWarning(UserWarning):
    """transformers is newer than the newest release CI tested this package on."""


def check_transformers(installed: str = transformers.__version__) -> None:
    """Refuse a transformers older than the tested range by name; warn (once, at import) about a newer one."""
    newest = Version(NEWEST_TRANSFORMERS)
    tested = f"transformers {OLDEST_TRANSFORMERS} to {newest.major}.{newest.minor}.x"
    version = Version(installed)
    supported = f"transformers>={OLDEST_TRANSFORMERS},<{newest.major}.{newest.minor + 1}"
    if version < Version(OLDEST_TRANSFORMERS):
        raise ImportError(f"hf_eagle31 needs {tested}; transformers {installed} is installed. "
                          f"Upgrade it: pip install '{supported}'")
    if version.release[:2] > newest.release[:2]:
        warnings.warn(f"hf_eagle31 is tested on {tested}; transformers {installed} is newer and may have changed the "
                      f"generation internals EAGLE routing relies on. If generate() fails, install "
                      f"'transformers<{newest.major}.{newest.minor + 1}'.", UntestedTransformersWarning, stacklevel=2)


check_transformers()

from transformers.generation.utils import ALL_CACHE_NAMES  # noqa: E402  (after the check: it names a bad version)
from transformers.utils import is_kernels_available  # noqa: E402

CACHE_KWARG: str = ALL_CACHE_NAMES[0]  # "cache" from transformers 5.24, "past_key_values" before

# From 5.25 `from_pretrained` replaces layers with Hub kernels unless asked not to, and raises where no `kernels`
# package of the version it needs is installed. The package's own loads then ask for none, which is what
# `USE_HUB_KERNELS=NO` does for every load; before 5.25 none is the default.
LOAD_KWARGS: dict = {} if is_kernels_available() else {"use_kernels": False}
