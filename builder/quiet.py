"""Keep transformers' progress bars and advisory warnings off the terminal during a build.

The build prints its own one line per stage; stderr is reserved for the one `error:` line.
"""
from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging

    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()
