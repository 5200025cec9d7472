"""Hypothesis's example counts, from a profile: ``ci`` (``make test``: each property test's full
count) or ``dev`` (``make test-fast`` and iteration: a tenth). ``HYPOTHESIS_PROFILE`` picks it;
a test asks ``examples(n)`` for its share of its full count ``n``."""

import os

from hypothesis import settings

SHARE = {"ci": 1.0, "dev": 0.1}
# a property test without a count of its own runs Hypothesis's default (100), or a tenth
settings.register_profile("ci", deadline=None, max_examples=100)
settings.register_profile("dev", deadline=None, max_examples=10)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
if PROFILE not in SHARE:
    raise ValueError(f"HYPOTHESIS_PROFILE={PROFILE!r}: one of {', '.join(SHARE)}")
settings.load_profile(PROFILE)


def examples(full: int) -> int:
    """The examples a property test with ``full`` of them runs under this profile."""
    return max(5, round(full * SHARE[PROFILE]))
