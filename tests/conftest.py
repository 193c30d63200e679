"""Property tests draw the same examples on every run (CI must not go red on a draw it never made
before); `HYPOTHESIS_PROFILE=explore pytest` searches fresh examples and keeps what it finds."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_finish(session):
    """The runtime tests' session pieces start building now, beside the tests before them."""
    from tests.runtime import prebuild

    builder = prebuild.start(session.items)
    if builder is not None:
        session.config.stash[prebuild.BUILDER] = builder


def pytest_unconfigure(config):
    from tests.runtime import prebuild

    builder = config.stash.get(prebuild.BUILDER, None)
    if builder is not None:
        builder.close()
