"""The configuration reference (docs/config.md), generated from the field comments of `mhl_jax.config`.

    python -m mhl_jax.config_reference > docs/config.md

tests/unit/test_config_reference.py fails when docs/config.md differs from what this prints, or a field has no
comment.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mhl_jax.config import Config, schema


@dataclass(frozen=True)
class FieldDoc:
    """One config key as docs/config.md lists it."""

    key: str  # dotted path, as `--set` takes it: "model.d_model"
    type: str  # the annotation, in words: "int", "float or null", "one of auto, triton, reference"
    default: str  # the default as YAML would write it
    comment: str  # the field's source comment, lines joined; empty when it has none


def _sections() -> list[tuple[str, type]]:
    """(section name, dataclass) in Config's order; the top-level keys under the name ""."""
    return [("", Config)] + [(f.name, f.default_factory) for f in dataclasses.fields(Config)
                             if dataclasses.is_dataclass(f.default_factory)]


def _source_comments(source: str) -> dict[int, str]:
    """Line number -> the text of the `#` comment on that line."""
    return {tok.start[0]: tok.string.lstrip("#").strip()
            for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}


def _type_words(annotation: ast.expr) -> str:
    """A field's annotation as a reader says it: Literal -> "one of a, b", Optional[T] -> "T or null"."""
    if isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name):
        args = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
        if annotation.value.id == "Literal":
            return "one of " + ", ".join(str(a.value) for a in args)
        if annotation.value.id == "Optional":
            return f"{_type_words(args[0])} or null"
    return ast.unparse(annotation)


def _default_words(value: Any) -> str:
    """The default as it would be written in a config file."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def field_docs() -> list[FieldDoc]:
    """Every config key with its type, default and comment, read from this module's source.

    A field's comment is the run of comment-only lines just above it plus the comment on its own line; reading
    the source (not docstrings) lets each comment sit beside its field, where it is kept up to date."""
    source = Path(schema.__file__).read_text()
    lines = source.splitlines()
    comments = _source_comments(source)
    classes = {node.name: node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)}
    docs = []
    for section, cls in _sections():
        defaults = cls()
        for node in classes[cls.__name__].body:
            if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
                continue
            name = node.target.id
            if dataclasses.is_dataclass(getattr(defaults, name)):
                continue  # a section, listed under its own heading
            above, line = [], node.lineno - 1
            while line >= 1 and lines[line - 1].strip().startswith("#"):
                above.insert(0, comments[line])
                line -= 1
            trailing = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
            docs.append(FieldDoc(key=f"{section}.{name}" if section else name, type=_type_words(node.annotation),
                                 default=_default_words(getattr(defaults, name)),
                                 comment=" ".join(above + trailing)))
    return docs


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def config_reference() -> str:
    """docs/config.md: every key of every section with its type, default and comment, as Markdown."""
    docs = field_docs()
    out = ["# Configuration reference", "",
           "<!-- Generated from the field comments of mhl_jax/config/schema.py by `python -m "
           "mhl_jax.config_reference > docs/config.md`; tests/unit/test_config_reference.py fails when the two "
           "differ. Edit the comments, not this file. -->", "",
           "A run's configuration is the defaults below, then a YAML file (`python train.py --config FILE`), then "
           "each `--set section.key=value` in order. Values are parsed as YAML (`1e-3`, `true`, `null`; an empty "
           "value is the empty string) and type-checked; an unknown key, a wrong type or values that disagree stop "
           "the run with an error naming them. The resolved configuration is written to `<run_dir>/config.yaml`.",
           ""]
    for section, cls in _sections():
        rows = [d for d in docs if (d.key.split(".")[0] == section if section else "." not in d.key)]
        out += [f"## {section or 'top level'}", "", inspect.getdoc(cls), "",
                "| key | type | default | meaning |", "|---|---|---|---|"]
        out += [f"| `{d.key}` | {_cell(d.type)} | `{d.default}` | {_cell(d.comment)} |" for d in rows]
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(config_reference())
