"""Argument checks whose messages name the argument and the allowed range."""
import math


def check_int(name: str, value, low: int, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {allowed}, got {value}")


def check_number(name: str, value, low: float, high: float | None = None, low_open: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    too_low = value <= low if low_open else value < low
    if too_low or (high is not None and value > high):
        if high is None:
            allowed = f"> {low}" if low_open else f">= {low}"
        else:
            allowed = f"in {'(' if low_open else '['}{low}, {high}]"
        raise ValueError(f"{name} must be {allowed}, got {value}")


def check_priority(priority) -> None:
    """A request priority: any int (lower first under scheduling_policy="priority")."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise TypeError(f"priority must be an int, got {priority!r}")


def priorities(priority, num_requests: int) -> list[int]:
    """A priority per request, from one int for all or a list of one per request."""
    values = list(priority) if isinstance(priority, (list, tuple)) else [priority] * num_requests
    if len(values) != num_requests:
        raise ValueError(f"priority has {len(values)} entries for {num_requests} prompts")
    for value in values:
        check_priority(value)
    return values
