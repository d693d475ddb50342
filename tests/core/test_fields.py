"""doc() is the dataclasses.field call the configs wrote by hand: same default or factory, same
help metadata; AReaL's loader (OmegaConf structured configs) and help readers see no difference."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, is_dataclass

import pytest
from omegaconf import OmegaConf

from cua_rl.core.fields import doc


@dataclass
class ByHand:
    port: int = field(default=0, metadata={"help": "Port; 0 picks one."})
    hosts: list[str] = field(default_factory=list, metadata={"help": "Allowed hosts."})
    name: str = field(default="x", metadata={"help": "A name."})


@dataclass
class ByDoc:
    port: int = doc(0, "Port; 0 picks one.")
    hosts: list[str] = doc(factory=list, help="Allowed hosts.")
    name: str = doc("x", "A name.")


def _shape(cls) -> list[tuple]:
    return [(f.name, f.type, f.default, f.default_factory, dict(f.metadata)) for f in fields(cls)]


def test_doc_declares_the_fields_written_by_hand():
    assert _shape(ByDoc) == _shape(ByHand)
    assert ByDoc().hosts is not ByDoc().hosts  # a factory, not one shared list
    by_doc = OmegaConf.structured(ByDoc)
    assert OmegaConf.to_container(by_doc) == OmegaConf.to_container(OmegaConf.structured(ByHand))
    merged = OmegaConf.merge(by_doc, OmegaConf.create({"port": 8, "hosts": ["a"]}))
    assert OmegaConf.to_object(merged) == ByDoc(port=8, hosts=["a"])


def test_a_required_field_and_the_refusals():
    assert doc(help="Required.").default is MISSING
    with pytest.raises(ValueError, match="help text"):
        doc(1, "  ")
    with pytest.raises(ValueError, match="not both"):
        doc(1, "Both.", factory=list)


def _ours(cls) -> bool:
    return cls.__module__.startswith("cua_rl")


def test_every_config_field_in_the_package_has_help():
    from cua_rl.app.config import CUAConfig

    seen, stack = set(), [CUAConfig]
    while stack:
        cls = stack.pop()
        if cls in seen or not _ours(cls):
            continue
        seen.add(cls)
        # Fields CUAConfig inherits from AReaL's config are AReaL's to document.
        areals = {
            f.name for b in cls.__mro__[1:] if is_dataclass(b) and not _ours(b) for f in fields(b)
        }
        for f in fields(cls):
            if f.name not in areals:
                assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help"
            if isinstance(f.default_factory, type) and hasattr(
                f.default_factory, "__dataclass_fields__"
            ):
                stack.append(f.default_factory)
    assert len(seen) > 5
