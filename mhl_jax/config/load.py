"""Reading a config: YAML files found by path or name, `--set a.b=value` overrides, types checked; and writing one
back (a run's config.yaml)."""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from mhl_jax.config.schema import Config, ConfigError, ScheduleConfig
from mhl_jax.config.validate import validate


def _shown(value: Any) -> str:
    """`value` as the user wrote it in YAML (true, null), not as Python prints it (True, None)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else repr(value)


def _check_type(path: str, value: Any, tp: Any) -> Any:
    """Return `value` converted to `tp` where that is lossless, else raise ConfigError."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{path}={_shown(value)}: expected one of {list(typing.get_args(tp))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _check_type(path, value, a)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{path}={_shown(value)}: wrong type")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}={_shown(value)}: expected a bool (true/false)")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}={_shown(value)}: expected an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{path}={_shown(value)}: expected a number")
    if tp is str:
        if isinstance(value, str):
            return value
        if value is None:  # YAML's null (e.g. --set data.path=null): the empty string is this field's "none"
            raise ConfigError(f"{path}=null: expected a string; for none give the empty one (--set {path}=)")
        raise ConfigError(f"{path}={_shown(value)}: expected a string")
    raise ConfigError(f"{path}: unsupported field type {tp}")


def _merge(obj: Any, data: dict, prefix: str) -> Any:
    """Return a copy of dataclass `obj` with the (nested) dict `data` applied, type-checked."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    updates = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f"unknown config key {path!r}; known keys here: {sorted(names)}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            updates[key] = _merge(current, value, path + ".")
        else:
            updates[key] = _check_type(path, value, hints[key])
    return dataclasses.replace(obj, **updates)


def parse_override(text: str) -> dict:
    """'a.b=value' -> {'a': {'b': value}} with value parsed as YAML (so 1e-3, true, null work)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected the form key.sub=value")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: bad key {key!r}")
    try:
        value = yaml.load(raw, Loader=_Loader) if raw.strip() else ""
    except yaml.YAMLError as e:
        reason = str(e).splitlines()[0]
        raise ConfigError(f"override {text!r}: the value {raw!r} is not valid YAML ({reason}); quote it or fix the "
                          "brackets") from e
    out: dict = {}
    cur = out
    parts = key.split(".")
    for part in parts[:-1]:
        cur = cur.setdefault(part, {})
    cur[parts[-1]] = value
    return out


class _Loader(yaml.SafeLoader):
    """YAML with YAML 1.2's floats: an unquoted 5e-4 or 1E3 is a number (YAML 1.1, PyYAML's default, reads them as
    strings); a quoted "1.0" stays a string."""


class _Dumper(yaml.SafeDumper):
    """Writes what `_Loader` reads back the same: a string such as "1e3" is quoted."""


for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
        list("-+0123456789."))


# The repository's configs/ folder, where a config named without a path is looked up (an editable install keeps
# the package inside the repository).
CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def find_config(spec: str) -> Path:
    """The YAML file `spec` names: a path (from the working directory), else a config of CONFIG_DIR by name, with or
    without `.yaml` and `configs/` (`tiny_moe`, `tiny_moe.yaml`, `configs/tiny_moe.yaml`) from any directory."""
    p = Path(spec).expanduser()
    if p.is_dir():
        raise ConfigError(f"config file {str(p)!r} is a directory; expected a YAML file such as "
                          "configs/tiny_mh_latent_moe.yaml")
    if p.is_file():
        return p
    if not p.is_absolute() and p.parent in (Path("."), Path("configs")):
        named = CONFIG_DIR / (p.name if p.suffix in (".yaml", ".yml") else f"{p.name}.yaml")
        if named.is_file():
            return named
        names = sorted(f.stem for f in CONFIG_DIR.glob("*.yaml"))
        have = f"configs: {', '.join(names)}" if names else "none there"
        raise ConfigError(f"config {spec!r}: no such file here, and no config of that name in {CONFIG_DIR} ({have})")
    raise ConfigError(f"config file {str(p)!r} does not exist")


def scale_schedule(s: ScheduleConfig) -> ScheduleConfig:
    """`s` with warmup_steps and decay_steps that are null set from total_steps: 8/15 and 2/15 of it (the paper's
    8000 and 2000 of 15000), each at most what an explicit other leaves. Explicit values stay as they are (`validate`
    refuses them if they do not fit)."""
    warmup, decay, total = s.warmup_steps, s.decay_steps, s.total_steps
    if warmup is None:
        warmup = max(0, min(total * 8 // 15, total - (decay or 0)))
    if decay is None:
        decay = max(0, min(total * 2 // 15, total - warmup))
    return dataclasses.replace(s, warmup_steps=warmup, decay_steps=decay)


def _read_yaml(p: Path) -> Any:
    """The mapping in YAML file `p`; ConfigError in one line (where and what) if it cannot be read or parsed."""
    try:
        data = yaml.load(p.read_text(encoding="utf-8"), Loader=_Loader)
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not UTF-8 text (byte {e.start}: {e.reason})") from e
    except OSError as e:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {e.strerror or e}") from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config file {str(p)!r} is not valid YAML{where}: {what}") from e
    return {} if data is None else data


def load_config(path: Optional[str] = None, overrides: tuple[str, ...] | list[str] = ()) -> Config:
    """Build a Config: defaults, then the YAML file at `path` (`find_config`), then each `a.b=value` override; a null
    warmup or decay scales with total_steps (`scale_schedule`)."""
    cfg = Config()
    if path is not None:
        p = find_config(path)
        data = _read_yaml(p)
        cfg = _merge(cfg, data, "")
    for text in overrides:
        cfg = _merge(cfg, parse_override(text), "")
    cfg = dataclasses.replace(cfg, schedule=scale_schedule(cfg.schedule))
    validate(cfg)
    return cfg


def saved_config(run_dir: str | Path) -> Path:
    """The config.yaml that train.py wrote into run directory `run_dir`; ConfigError when there is none."""
    run = Path(run_dir).expanduser()
    if not run.is_dir():
        what = "is a file, not a directory" if run.exists() else "does not exist"
        raise ConfigError(f"run directory {str(run_dir)!r} {what} (expected a logging.run_dir written by train.py)")
    if not (run / "config.yaml").is_file():
        raise ConfigError(f"run directory {str(run_dir)!r} holds no config.yaml; expected a logging.run_dir written "
                          "by train.py")
    return run / "config.yaml"


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def dump_config(cfg: Config) -> str:
    """The config as YAML that `load_config` reads back to the same Config (a run's config.yaml)."""
    return yaml.dump(config_to_dict(cfg), Dumper=_Dumper, sort_keys=False)
