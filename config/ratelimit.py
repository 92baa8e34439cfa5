"""Rate limits per user and action, counted in Django's cache (Redis when there is one).

A fixed window: the first hit of a window creates its counter with the window's
lifetime, every hit increments it, and a hit over the limit is refused with how long
until the window ends. Limits are settings (RATE_LIMITS, "COUNT/PERIOD").
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from functools import wraps

from django.conf import settings
from django.core.cache import cache
from django.http import HttpRequest, HttpResponse

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_RATE = re.compile(r"^\s*(\d+)\s*/\s*(\d*)\s*([smhd])\s*$")

ACTION_NAMES = {
    "thesis-submit": "theses filed",
    "sweep-start": "sweeps started",
    "candidate-decide": "keep or revert decisions",
    "api-post": "API writes",
    "api-token-create": "API tokens made",
}


class RateLimited(Exception):
    def __init__(self, *, action: str, limit: int, period_s: int, retry_after_s: int) -> None:
        self.action, self.limit, self.period_s, self.retry_after_s = action, limit, period_s, retry_after_s
        what = ACTION_NAMES.get(action, action)
        super().__init__(f"Too many {what}: at most {limit} every {_duration(period_s)}. "
                         f"Try again in {_duration(retry_after_s)}.")


def _duration(seconds: int) -> str:
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds % size == 0:
            return _plural(seconds // size, unit)
    if seconds > 120:
        return _plural(-(-seconds // 60), "minute")
    return _plural(seconds, "second")


def _plural(count: int, unit: str) -> str:
    return f"{count} {unit}{'' if count == 1 else 's'}"


def parse_rate(rate: str) -> tuple[int, int]:
    """"20/h" -> (20, 3600); "100/10m" -> (100, 600)."""
    match = _RATE.match(rate)
    if not match:
        raise ValueError(f"a rate is COUNT/PERIOD like 20/h or 100/10m, not {rate!r}")
    count, multiple, unit = match.groups()
    return int(count), int(multiple or 1) * _UNITS[unit]


def rate_limit_hit(*, user, action: str) -> None:
    """Counts one `action` by `user`; raises RateLimited when that is over the limit."""
    limit, period_s = parse_rate(settings.RATE_LIMITS[action])
    now = time.time()
    window = int(now // period_s)
    key = f"ratelimit:{action}:{user.pk}:{window}"
    cache.add(key, 0, timeout=period_s + 1)
    try:
        count = cache.incr(key)
    except ValueError:  # expired between add and incr: this hit starts the window
        cache.set(key, 1, timeout=period_s + 1)
        count = 1
    if count > limit:
        retry_after = max(1, int((window + 1) * period_s - now) + 1)
        raise RateLimited(action=action, limit=limit, period_s=period_s, retry_after_s=retry_after)


def rate_limited_response(refusal: RateLimited) -> HttpResponse:
    response = HttpResponse(str(refusal), status=429, content_type="text/plain; charset=utf-8")
    response["Retry-After"] = str(refusal.retry_after_s)
    return response


def rate_limited(action: str) -> Callable:
    """A view decorator: each POST counts as one `action` of the logged-in user."""

    def decorator(view: Callable) -> Callable:
        @wraps(view)
        def wrapper(request: HttpRequest, *args, **kwargs) -> HttpResponse:
            if request.method == "POST":
                try:
                    rate_limit_hit(user=request.user, action=action)
                except RateLimited as refusal:
                    return rate_limited_response(refusal)
            return view(request, *args, **kwargs)

        return wrapper

    return decorator
