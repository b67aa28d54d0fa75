"""Small helpers the checkpoint reliability tests share."""

from __future__ import annotations


def cpu_params(params: dict) -> dict:
    """Detached CPU copies of ``params`` (a name -> tensor dict)."""
    return {n: t.detach().cpu().clone() for n, t in params.items()}


def error_text(fn) -> str | None:
    """``fn()``'s exception as text (with its causes), or None when it returned."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects every kind
        parts, cause = [f"{type(e).__name__}: {e}"], e.__cause__
        while cause is not None:
            parts.append(f"{type(cause).__name__}: {cause}")
            cause = cause.__cause__
        return " <- ".join(parts)
    return None
