"""The recipe field reference in docs/recipes.md, rendered from the schema (`make docs`).

The schema's field descriptions, types and defaults are the one source: the docs table is written from them
between two markers, and tests/test_docs.py fails when the file and the schema differ. Hand-written because
pydantic's JSON schema has the facts but no readable table.
"""

from __future__ import annotations

import re
import sys
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from disttrain.recipe.schema import Recipe, RewardSection, SourceSection, _SourceFields

DOC = Path(__file__).resolve().parents[2] / "docs" / "recipes.md"
BEGIN = "<!-- BEGIN field reference: generated from disttrain/recipe/schema.py by `make docs`; edit the schema -->"
END = "<!-- END field reference -->"
_DOC_LINK = re.compile(r"docs/([a-z_]+\.md)")


def _section_class(annotation) -> type[BaseModel] | None:
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


_ENTRIES = {SourceSection: "sources", RewardSection: "reward functions"}  # lists of sections, tabled after theirs


def _type(annotation) -> str:
    """A YAML user's reading of the annotation: choices, lists, maps, 'or null'."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " / ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        kinds = [_type(a) for a in args if a is not type(None)]
        return " or ".join(kinds) + (" or null" if type(None) in args else "")
    if origin is list:
        entry = _section_class(args[0])
        return f"list of {_ENTRIES[entry]} (below)" if entry else f"list of {_type(args[0])}"
    if origin is dict:
        return f"map {_type(args[0])} → {_type(args[1])}"
    return {str: "text", int: "integer", float: "number", bool: "true / false"}.get(annotation, str(annotation))


def _default(field) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (list, dict)):
        return f"`{value!r}`".replace("'", "") if value else ("`[]`" if isinstance(value, list) else "`{}`")
    return f"`{value}`"


def _meaning(field) -> str:
    text = (field.description or "").replace("|", "\\|")
    return _DOC_LINK.sub(r"[\1](\1)", text)


def _table(prefix: str, section: type[BaseModel], skip: tuple[str, ...] = ()) -> list[str]:
    """The section's own fields first (data: path, format, sources), then those it shares with a base class."""
    inherited = {name for base in section.__mro__[1:] for name in getattr(base, "model_fields", {})}
    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for name, field in sorted(section.model_fields.items(), key=lambda item: item[0] in inherited):
        if name not in skip:
            rows.append(f"| `{prefix}{name}` | {_type(field.annotation)} | {_default(field)} | {_meaning(field)} |")
    return rows


def _doc(section: type[BaseModel]) -> list[str]:
    own = section.__dict__.get("__doc__")
    return [" ".join(own.split()), ""] if own else []


def reference() -> str:
    """The generated block: one table per recipe section, the mixture's source fields after data."""
    lines = [BEGIN]
    for name, field in Recipe.model_fields.items():
        section = _section_class(field.annotation)
        required = "required" if field.is_required() else "optional"
        lines += ["", f"### `{name}` ({required})", "", *_doc(section), *_table(f"{name}.", section)]
        if name == "data":
            shared = tuple(n for n in SourceSection.model_fields if n in _SourceFields.model_fields)
            lines += ["", "Each entry of `data.sources` (a mixture) takes these, and the fields it shares with "
                      "`data` (`" + "`, `".join(shared) + "`):", "",
                      *_table("data.sources[].", SourceSection, skip=shared)]
        if name == "rl":
            lines += ["", "Each entry of `rl.rewards` takes these:", "", *_table("rl.rewards[].", RewardSection)]
    return "\n".join(lines + ["", END])


def rendered(text: str) -> str:
    """`text` (docs/recipes.md) with its generated block replaced by the schema's."""
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + reference() + text[stop:]


def main() -> None:
    DOC.write_text(rendered(DOC.read_text()))
    print(f"wrote {DOC.relative_to(Path.cwd()) if DOC.is_relative_to(Path.cwd()) else DOC}")


if __name__ == "__main__":
    sys.exit(main())
