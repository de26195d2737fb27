"""runtime_settings.json: what `tandem profile` measured and tuned for an engine dir on this device.

    {"verify_width_per_batch": {"1": 4, "8": 2},              the width each batch size starts at
     "round_seconds_per_batch": {"1": {"1": 0.0006, "4": 0.0016}, ...},
                                                              seconds per round (width 1: one plain
                                                              step), the adaptive width's cost model
                                                              until it has measured its own
     "constrained_round_seconds_per_batch": {...}}            the same under a JSON schema (optional)

The manifest does not cover this file (profile writes it after the build), so every value is
checked here and a bad one is refused naming the file and how to fix it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from tandem.engines.manifest import ManifestError

RUNTIME_SETTINGS = "runtime_settings.json"


@dataclass(frozen=True)
class RuntimeSettings:
    widths: dict[int, int] = field(default_factory=dict)              # batch size -> starting verify width
    round_seconds: dict[int, dict[int, float]] = field(default_factory=dict)   # batch -> width -> seconds
    constrained_round_seconds: dict[int, dict[int, float]] = field(default_factory=dict)   # under a grammar


def read_runtime_settings(engine_dir: Path, verify_widths: set[int]) -> RuntimeSettings:
    """The engine dir's runtime_settings.json, checked (none there: empty settings)."""
    path = engine_dir / RUNTIME_SETTINGS
    if not path.exists():
        return RuntimeSettings()
    fix = (f"run `tandem profile {path.parent} --out REPORT` again to rewrite it, or delete it to use the "
           "manifest's widths")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ManifestError(f"{path} cannot be read as JSON ({e}); {fix}") from e
    tuned = data.get("verify_width_per_batch", {}) if isinstance(data, dict) else None
    if not isinstance(tuned, dict):
        raise ManifestError(f"{path}: expected an object with \"verify_width_per_batch\": {{batch size: width}}; {fix}")
    allowed = sorted(verify_widths | {1})

    def width(value, batch: str, key: bool = False, where: str = "") -> int:
        """A width: an integer value, or (key) a key of digits; `where`: the field it is in."""
        number = value if type(value) is int and not key else \
            int(value) if key and value.isascii() and value.isdigit() else None
        if number not in allowed:
            raise ManifestError(f"{path}: {where}verify width {value!r} for batch size {batch} is not one the engines "
                                f"were built for ({', '.join(map(str, allowed))}); {fix}")
        return number

    def seconds_per_round(key: str) -> dict[int, dict[int, float]]:
        costs = data.get(key, {})
        if not isinstance(costs, dict) or not all(isinstance(c, dict) for c in costs.values()):
            raise ManifestError(f"{path}: \"{key}\" must be {{batch size: {{width: seconds}}}}; {fix}")
        out = {}
        for b, per_width in costs.items():
            batch = _batch(path, b, fix)
            out[batch] = {}
            for w, seconds in per_width.items():
                if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
                        or seconds <= 0:
                    raise ManifestError(f"{path}: {key}: round seconds {seconds!r} at batch size {b}, width {w} "
                                        f"must be a positive number; {fix}")
                out[batch][width(w, b, key=True, where=f"{key}: ")] = float(seconds)
        return out

    widths = {_batch(path, b, fix): width(w, b) for b, w in tuned.items()}
    return RuntimeSettings(widths, seconds_per_round("round_seconds_per_batch"),
                           seconds_per_round("constrained_round_seconds_per_batch"))


def _batch(path: Path, batch: str, fix: str) -> int:
    if not (batch.isascii() and batch.isdigit() and int(batch) > 0):
        raise ManifestError(f"{path}: batch size {batch!r} is not a positive integer; {fix}")
    return int(batch)
