"""docs/config.md is generated from mhl_jax/config/schema.py's field comments: every key documented, the file up to
date."""

from pathlib import Path

from mhl_jax.config import Config, load_config
from mhl_jax.config_reference import config_reference, field_docs

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_every_field_has_a_comment():
    missing = [d.key for d in field_docs() if not d.comment]
    assert not missing, ("config fields without a comment (add one beside the field in mhl_jax/config/schema.py): "
                         f"{missing}")


def test_reference_lists_every_key_once():
    keys = [d.key for d in field_docs()]
    assert len(keys) == len(set(keys))
    for key in keys:  # each listed key is one --set accepts
        section, _, name = key.rpartition(".")
        assert hasattr(getattr(Config(), section) if section else Config(), name), key
    assert "model.d_model" in keys and "parallel.hp" in keys and "name" in keys
    load_config(None, [f"{d.key}={d.default}" for d in field_docs() if d.default != '""'])  # defaults read back


def test_docs_config_md_is_current():
    assert DOC.read_text() == config_reference(), (
        "docs/config.md differs from mhl_jax/config/schema.py's field comments; regenerate it with "
        "`python -m mhl_jax.config_reference > docs/config.md`")
