"""Converting a drafter checkpoint between layouts, losslessly: read in any layout, write in another.

`conversion.layouts` reads and writes each layout and sits below the drafter model, which reads
through it (`Eagle3DraftModel.from_pretrained`); a conversion loads the drafter, so it sits above the model.
"""

from __future__ import annotations

from pathlib import Path

from hf_eagle31.conversion.layouts import LAYOUTS, save_in_layout
from hf_eagle31.folders import replace_folder
from hf_eagle31.modeling import Eagle3DraftModel


def convert_checkpoint(src: str | Path, dst: str | Path, layout: str = "hf_eagle31", allow_pickle: bool = False,
                       overwrite: bool = False, verifier: str | None = None, local_verifier: bool = False) -> Path:
    """Read `src` in any supported layout and write it to `dst` in `layout`: same weights, same outputs.

    `verifier` names the target in a speculators export (default: the one `src` records, from its
    speculators config or its model card's `base_model`), by its Hub id unless `local_verifier`. `dst` must be new
    or empty unless `overwrite`; it is written whole or not at all (`replace_folder`).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    with replace_folder(dst, overwrite, source=src) as scratch:
        save_in_layout(Eagle3DraftModel.from_pretrained(src, allow_pickle=allow_pickle), scratch, layout, verifier,
                       local_verifier)
    return Path(dst)
