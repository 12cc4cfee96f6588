"""Named datasets that `python -m mhl_jax.data.prepare NAME` fetches, tokenizes and names as the configs read them.

    python -m mhl_jax.data.prepare fineweb10B    # FineWeb-Edu sample-10BT, GPT-2 tokens -> data/fineweb10B/

A recipe is a Hugging Face dataset (streamed: no copy of the text is kept), a tokenizer and the shard names: the
paper configs read `data/fineweb10B/fineweb_train_*.bin` and `fineweb_val_*.bin` (modded-nanogpt's names), relative
to the directory train.py runs in. Before anything is read, `check_hub` asks the hub for the dataset, so a machine
without access is told so in one line rather than by a stack of connection errors.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass

from mhl_jax.data.errors import DataError
from mhl_jax.data.hf_source import local_files


@dataclass(frozen=True)
class Recipe:
    """Where a named dataset comes from, how it is tokenized, and where its shards go."""

    name: str
    source: str  # a Hugging Face dataset name (local files work too: what the tests read)
    hf_config: str  # the dataset's configuration
    split: str
    text_column: str
    tokenizer: str
    out: str  # the default --out: the directory the configs read, relative to where train.py runs
    prefix: str  # shard names: {prefix}val_000000.bin, ..., {prefix}train_000000.bin, ...


RECIPES = {
    # the paper's data: FineWeb-Edu's 10B-token sample (~9.7M documents), GPT-2 tokens, as the paper configs read it
    "fineweb10B": Recipe("fineweb10B", "HuggingFaceFW/fineweb-edu", "sample-10BT", "train", "text", "gpt2",
                         "data/fineweb10B", "fineweb_"),
}


def hub_endpoint() -> str:
    """The hub `datasets` talks to: $HF_ENDPOINT, else huggingface.co."""
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def check_hub(recipe: Recipe, timeout: float = 20.0) -> None:
    """Raise a one-line DataError unless the hub answers for the recipe's dataset (nothing to check for local
    files)."""
    if local_files(recipe.source, recipe.name) is not None:
        return
    endpoint = hub_endpoint()
    where = f"{recipe.name} streams {recipe.source} ({recipe.hf_config}) from the Hugging Face hub"
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise DataError(f"{where}, and HF_HUB_OFFLINE is set: unset it, or run this on a machine with access and "
                        f"copy {recipe.out}/ here")
    url = f"{endpoint}/api/datasets/{recipe.source}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            json.load(answer)
    except urllib.error.HTTPError as e:  # the hub answered, with an error
        raise DataError(f"{where}, which answered {url} with HTTP {e.code} {e.reason}") from e
    except (urllib.error.URLError, OSError, ValueError) as e:  # no answer: DNS, refused, timeout, a proxy's page
        reason = getattr(e, "reason", e)
        raise DataError(f"{where}, which is not reachable from this machine ({endpoint}: {reason}); run this on a "
                        f"machine with access and copy {recipe.out}/ here, or set HF_ENDPOINT to a mirror") from e
