"""Argument checks shared by the savers: a step, ``keep`` and JSON ``extra`` metadata."""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["check_json", "check_keep", "check_step"]


def check_step(step: Any) -> int:
    if isinstance(step, torch.Tensor) and step.dim() == 0 and not step.is_floating_point():
        step = int(step.item())
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r}: expected an int >= 0 (e.g. int(state.step))")
    return step


def check_keep(keep: Any) -> int | None:
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep={keep!r}: expected an int >= 1 (or None to keep every checkpoint)")
    return keep


def check_json(where: str, value: Any) -> None:
    # walk first so the error names the offending key, which json.dumps does not
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: key {k!r} is not a str; JSON objects need str keys")
            check_json(f"{where}[{k!r}]", v)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_json(f"{where}[{i}]", v)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: {value!r} is not valid JSON; store it as a string")
    elif not (value is None or isinstance(value, (str, int, float, bool))):
        raise TypeError(
            f"{where}: {type(value).__name__} is not JSON-able; convert it first "
            "(attrs.asdict(config), tensor.tolist(), str(path))"
        )
