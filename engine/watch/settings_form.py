"""The context settings a front-end lets a user change, as text fields: their names and meanings, how a
field's text becomes a setting (a bad value raises ValueError naming the field), and the estimate of the
memory they would take, written as both explorers show it before the settings are applied."""
from __future__ import annotations

from engine.llama_flags import SETTING_FLAGS

# name, kind, what it is ({flag}: the llama.cpp flag that sets it)
SETTINGS = tuple((name, kind, what.format(flag=SETTING_FLAGS[name])) for name, kind, what in (
    ("n_ctx", int, "cells in all ({flag})"), ("pad", int, "padding of sizes (llama.cpp: 256)"),
    ("n_seq_max", int, "sequences ({flag})"), ("kv_unified", bool, "one stream for all ({flag})"),
    ("type_k", str, "K cache type ({flag})"), ("type_v", str, "V cache type ({flag})"),
    ("swa_full", bool, "full-size SWA cache ({flag})"), ("swa_window", int, "sliding window ({flag})"),
    ("n_gpu_layers", int, "layers offloaded ({flag})"), ("tensor_split", list, "split across GPUs ({flag} 3,1)"),
    ("offload_kqv", bool, "K/V on the layers' devices (off: {flag})"),
    ("devices", list, "virtual GPUs ({flag} VGPU0=2GiB,VGPU1=1GiB)"),
))
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def shown(value) -> str:
    """A setting's value as a field shows it ("" for unset)."""
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def parse_setting(name: str, kind: type, raw: str):
    """One field's text as a setting of `kind`; ValueError naming the field when it is not one."""
    try:
        if kind is bool:
            if raw.lower() not in _TRUE + _FALSE:
                raise ValueError(raw)
            return raw.lower() in _TRUE
        if kind is int:
            return int(raw)
        if kind is list:
            items = [p.strip() for p in raw.split(",") if p.strip()]
            return [float(p) for p in items] if name == "tensor_split" else items
        return raw
    except ValueError:
        what = {int: "a whole number", bool: "true or false", list: "a comma-separated list"}.get(kind, kind.__name__)
        raise ValueError(f"{name}: {raw!r} is not {what}") from None


def parse_settings(fields: dict[str, str]) -> dict:
    """The settings the fields name (field name -> text); empty, "None" or "default": left as it is."""
    kinds = {name: kind for name, kind, _ in SETTINGS}
    out = {}
    for name, raw in fields.items():
        if name not in kinds:
            raise ValueError(f"{name}: not a setting (settings: {', '.join(kinds)})")
        raw = raw.strip()
        if raw not in ("", "None", "default"):
            out[name] = parse_setting(name, kinds[name], raw)
    return out


def estimate_lines(result) -> tuple[bool, list[str]]:
    """(whether it fits, a line per device) of Session.estimate()'s result (or its to_dict())."""
    data = result.to_dict() if hasattr(result, "to_dict") else result
    fits = bool(data.get("fits", True))
    lines = [f"fits: {data.get('fits')}"]
    for d in data.get("devices", []):
        cap = f" of {d['capacity'] / 2**20:.0f} MiB" if d.get("capacity") else ""
        lines.append(f"{d['device']:<10} weights {d['model_bytes'] / 2**20:8.1f} MiB · K/V "
                     f"{d['kv_bytes'] / 2**20:8.1f} MiB · compute {d['compute_bytes'] / 2**20:8.1f} MiB · "
                     f"total {d['total_bytes'] / 2**20:8.1f} MiB{cap}" + (" (virtual)" if d.get("virtual") else "")
                     + ("" if d.get("fits", True) else "  DOES NOT FIT"))
    return fits, lines
