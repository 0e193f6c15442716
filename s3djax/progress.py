"""Progress bars for people: drawn on stderr only when it is a terminal, or when asked (--progress).

A log, a CI job or a captured stderr then holds the one-line summaries, not carriage-return frames.
"""

from __future__ import annotations

import sys

FORCE = False  # set by the command lines' --progress


def bar(iterable=None, *, show: bool | None = None, **kwargs):
    """A tqdm bar; `show` None: only for a terminal (or --progress), False: never, True: always."""
    from tqdm import tqdm

    if show is None:
        show = FORCE or sys.stderr.isatty()
    return tqdm(iterable, file=sys.stderr, disable=not show, **kwargs)
