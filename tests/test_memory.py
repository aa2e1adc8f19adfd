import sys

import pytest

from codeloop.memory import resident_bytes, total_bytes, trim_when_above


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")
def test_trims_only_above_the_share() -> None:
    assert 0 < resident_bytes() < total_bytes()
    assert trim_when_above(share=0.0)  # any process holds more than nothing
    assert not trim_when_above(share=1.0)  # none holds more than the whole machine
