"""tools/bench/regions.py's measurements: a request that fails after its first token is a
failure, and percentiles interpolate as loadtest's and vLLM's do."""

from __future__ import annotations

import time

import aiohttp
import pytest

from tests.fake_openai_server import FakeConfig, FakeServer
from tools.bench.regions import Shape, one, percentile


def test_percentiles_interpolate() -> None:
    assert percentile([10, 20, 30, 40], 0.5) == 25.0  # the upper median was taken
    assert percentile(list(range(1, 101)), 0.99) == pytest.approx(99.01)  # not the maximum
    assert percentile([], 0.5) != percentile([], 0.5)  # NaN


async def test_a_stream_that_fails_after_its_first_token_is_no_success() -> None:
    """A mid-stream error comes as an error chunk in a 200 response: it counted as a good
    request with the TTFT of its first token."""
    server = FakeServer(FakeConfig(ttft_s=0.01, itl_s=0.001, num_tokens=4,
                                   pattern=["ok", "error_event", "cut"])).start()  # fmt: skip
    try:
        url = server.base_url + "/completions"
        async with aiohttp.ClientSession() as session:
            got = [await one(session, url, Shape(4), time.monotonic()) for _ in range(3)]
    finally:
        server.stop()
    assert got[0] is not None and got[0] > 0
    assert got[1] is None and got[2] is None  # the error event; no [DONE]
