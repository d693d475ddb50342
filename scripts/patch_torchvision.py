"""Make PyPI's CUDA torchvision importable next to CPU torch.

PyPI only ships a CUDA build of torchvision. With CPU torch its compiled ops do not load, and
the import dies when ``torchvision/_meta_registrations.py`` registers fake kernels for the
``torchvision::nms`` / ``torchvision::qnms`` operators that were never defined. Qwen-VL code
needs only torchvision's pure-Python transforms, so we make those two registrations skip when the
operator is missing. Idempotent: a patched file is left alone.

Usage: python scripts/patch_torchvision.py [SITE_PACKAGES]   (default: this interpreter's)
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

MARKER = "# cua-rl: registrations skip operators that the CPU torch cannot load"
HELPER = f"""
{MARKER}
def _cua_register_fake(name):
    def deco(fn):
        try:
            return torch.library.register_fake(name)(fn)
        except RuntimeError:
            return fn

    return deco

"""
TARGETS = (
    '@torch.library.register_fake("torchvision::nms")',
    '@torch.library.register_fake("torchvision::qnms")',
)


def patch(site_packages: Path) -> str:
    path = site_packages / "torchvision" / "_meta_registrations.py"
    if not path.exists():
        raise SystemExit(f"torchvision is not installed under {site_packages}")
    text = path.read_text()
    if MARKER in text:
        return f"already patched: {path}"
    missing = [t for t in TARGETS if t not in text]
    if missing:
        raise SystemExit(f"{path} does not contain {missing}; this torchvision needs a new patch")
    for target in TARGETS:
        text = text.replace(
            target, target.replace("torch.library.register_fake", "_cua_register_fake")
        )
    anchor = "import torch\n"
    if anchor not in text:
        raise SystemExit(f"{path}: no 'import torch' line to anchor the helper")
    text = text.replace(anchor, anchor + HELPER, 1)
    path.write_text(text)
    return f"patched: {path}"


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(sysconfig.get_paths()["purelib"])
    print(patch(target))
