"""Read a service's ``/metrics`` page (Prometheus text format) in one request."""

from __future__ import annotations

import urllib.request
from collections import defaultdict


def metric_sums(url: str) -> dict[str, float]:
    """Each sample name on the page (``meshserve:x_total``, ``..._sum``, ``..._count``) and
    the sum of its value over every label set."""
    sums: dict[str, float] = defaultdict(float)
    with urllib.request.urlopen(url, timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if not line or line.startswith("#"):
                continue
            sample, value = line.rsplit(" ", 1)
            sums[sample.split("{", 1)[0]] += float(value)
    return dict(sums)
